"""Validate the vision-language planner (``rocktune.tasks.vlm.planner.vlm``) against real training steps; prints one
JSON object.

    python benchmarks/planner_validation_vlm.py            # CPU grid: tiny Qwen-VLs, Gemma 3, SmolVLM; 3 sizes
    python benchmarks/planner_validation_vlm.py --markdown # the same as a table

One real step of a random-init tiny Qwen2.5-VL (``rocktune.tasks.vlm.demo.tiny_vlm``: 2 text layers, 2 vision blocks,
the first with full attention, the second with window attention; a narrow and a wide tower) per grid point, built and
trained as task=vlm builds and trains it (``tasks/vlm/build.py``'s LoRA on the language model, the vision side
frozen; ``VisionLoss``; AdamW), and of a tiny Gemma 3 and SmolVLM (``rocktune.tasks.vlm.demo.tiny_vlm_families``, a
256-wide SigLIP tower), on conversations encoded by the data code (``tasks/vlm/data/vision.py``) from PNG images of the
given size. Three figures:

- saved for backward: ``torch.autograd.graph.saved_tensors_hooks``, deduplicated by storage, parameters excluded
  (as ``planner_validation.py``), against the plan's saved terms;
- the training state (base weights, LoRA parameters, gradients, AdamW states), counted from the tensors: exact;
- the peak: the second step is run under torch's profiler with ``profile_memory`` (every CPU allocation and free,
  from the allocator), and its highest point plus the tensors that existed before it (weights, adapters, their
  gradients and AdamW states, the batch) is compared with the plan's ``peak_allocated``.

The SigLIP towers (Gemma 3, SmolVLM) are also measured alone (``tower_point``): their frozen forward's CPU peak on
34 views against the plan's ``vision_forward``, since the step grid's tiny towers do not set a step's peak.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import weakref
from contextlib import nullcontext
from pathlib import Path

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
MAX_PIXELS = 448 * 448  # the processor's limit for the runs: every size below is kept as it is
# Qwen2.5-VL with 2 text layers (hidden 128) and 2 vision blocks (the first full attention, the second windows of 56
# pixels): a narrow tower (hidden 64), whose step peaks in the language model's backward, and a wide one (hidden 256),
# whose forward sets the peak at the larger images; a wide Qwen3-VL (16-pixel patches, deepstack) and the demo's
# Qwen2-VL (its tower 32 wide) as well
MODELS = {"tiny": {"vision_hidden": 64, "vision_depth": 2}, "wide-vision": {"vision_hidden": 256, "vision_depth": 2},
          "qwen3-vl-wide": {"family": "qwen3_vl", "vision_hidden": 256, "vision_depth": 2},
          "qwen2-vl": {"family": "qwen2_vl", "vision_depth": 2}}
SIZES = ((112, 112), (224, 168), (448, 336))
# Gemma 3 and SmolVLM (``rocktune.tasks.vlm.demo.tiny_vlm_families``: 2 text layers, a SigLIP tower of 32-pixel views
# in 8-pixel patches) with a wide tower; SmolVLM's processor here splits images of up to 128 pixels a side into 32-pixel
# tiles (up to 4 x 4 and the global view). Gemma 3 resizes every image to its one size: the three sizes make the same
# step.
FAMILY_MODELS = {"gemma3-wide": {"family": "gemma3", "vision_hidden": 256, "vision_depth": 2},
                 "smolvlm-wide": {"family": "smolvlm", "vision_hidden": 256, "vision_depth": 2}}
TILE_EDGE = 128
FAMILY_SIZES = ((64, 64), (128, 64), (128, 32))  # SmolVLM: 4 x 4, 4 x 2, 4 x 1 tiles and the global view
MODELS.update(FAMILY_MODELS)
# (model, width, height, micro-batch, precision, checkpointing): three image sizes on each model, the largest also
# with checkpointing and in bf16 on the Qwen2.5-VLs
GRID = [(m, w, h, 2, "fp32", False) for m in MODELS if m not in FAMILY_MODELS for w, h in SIZES]
GRID += [(m, w, h, 2, "fp32", False) for m in FAMILY_MODELS for w, h in FAMILY_SIZES]
GRID += [(m, 128, 96, 2, "fp32", True) for m in FAMILY_MODELS]
GRID += [(m, 448, 336, 2, "fp32", True) for m in ("tiny", "wide-vision")]
GRID += [(m, 448, 336, 1, "bf16", False) for m in ("tiny", "wide-vision")]


def build_model_dir(folder: Path, name: str) -> Path:
    from rocktune.tasks.vlm.demo.tiny_vlm import build_tiny_vlm

    if name not in FAMILY_MODELS:
        return build_tiny_vlm(folder / name, **MODELS[name])
    import transformers

    from rocktune.tasks.vlm.demo.tiny_vlm_families import build_family_vlm

    shape = dict(MODELS[name])
    out = build_family_vlm(folder / name, 0, shape.pop("family"), **shape)
    if name.startswith("smolvlm"):
        transformers.SmolVLMImageProcessor(size={"longest_edge": TILE_EDGE}, max_image_size={"longest_edge": 32},
                                           do_image_splitting=True).save_pretrained(out)
    return out


def _language_layers(model):
    inner = model.get_base_model().model
    return getattr(inner, "language_model", None) or inner.text_model


def write_data(folder: Path, width: int, height: int, rows: int) -> Path:
    """``rows`` conversations, each one image of ``width`` x ``height`` and the same question and answer."""
    from PIL import Image

    from rocktune.tasks.vlm.demo.vision_task import row

    folder.mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(rows):
        name = f"img{i}_{width}x{height}.png"
        Image.new("RGB", (width, height), (40 * i % 255, 90, 160)).save(folder / name)
        lines.append(json.dumps(row(name, "blue")))
    path = folder / f"data_{width}x{height}.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def _storage_key(t: torch.Tensor):
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


def _counting(fn, keep):
    """The text planner's validation's wrapper of a checkpointed layer (its inputs counted), loaded from beside this
    file: benchmarks/ is not a package, and the tests load this script by its path."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("planner_validation", Path(__file__).with_name(
        "planner_validation.py"))
    text = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(text)
    return text._counting(fn, keep)


def _step(loss_module, batch, opt, precision: str, hooks=None, after_forward=None):
    ctx = torch.autocast("cpu", dtype=DTYPES[precision]) if precision != "fp32" else nullcontext()
    with (hooks or nullcontext()), ctx:
        loss, n = loss_module.sum_and_count(batch)
    if after_forward is not None:
        after_forward()
    (loss / n).backward()
    opt.step()
    return n


def measure(model_dir: Path, data: Path, b: int, precision: str, ckpt: bool) -> dict:
    from transformers import AutoConfig

    from rocktune.config import LoraConfig, ModelConfig
    from rocktune.data.records import read_records
    from rocktune.tasks.vlm.data.vision import encode
    from rocktune.tasks.vlm.data.vision_batch import collate
    from rocktune.models.load import load_tokenizer
    from rocktune.tasks.vlm.build import model_with_adapter
    from rocktune.tasks.vlm.loss import VisionLoss
    from rocktune.tasks.vlm.vision.model import vision_tokens

    tok = load_tokenizer(str(model_dir), False)
    config = AutoConfig.from_pretrained(model_dir)
    vision = vision_tokens(str(model_dir), config, tok, None, MAX_PIXELS if "qwen" in config.model_type else None)
    examples = [encode(r, data.parent, tok, vision, 4096, str(loc)) for loc, r in read_records(data)[:b]]
    batch = collate(examples, tok.pad_token_id, vision)
    torch.manual_seed(0)
    model, _ = model_with_adapter(ModelConfig(name_or_path=str(model_dir), gradient_checkpointing=ckpt),
                                  LoraConfig(r=8, alpha=16), precision, "sdpa", "cpu")
    model.train()
    loss_module = VisionLoss(model, 256)
    params = {_storage_key(p)[0] for p in model.parameters()} | {_storage_key(x)[0] for x in model.buffers()}
    saved: dict[int, tuple[int, list]] = {}

    def keep(t):
        # A checkpointed block whose input needs no gradient (the frozen vision tower's) still packs its input, but
        # no graph keeps it: only what is alive when the forward ends is counted (weak references).
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            ptr, n = _storage_key(t)
            if ptr not in params and n:
                entry = saved.get(ptr)
                if entry is None or not any(r() is not None for r in entry[1]):
                    entry = saved[ptr] = (n, [])  # a new storage (the address of a freed one may come back)
                entry[1].append(weakref.ref(t))

    def pack(t):
        keep(t)
        return t

    if ckpt:  # checkpoint inputs are kept alive outside the hooks
        for layer in _language_layers(model).layers:
            layer._gradient_checkpointing_func = _counting(layer._gradient_checkpointing_func, keep)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-3, foreach=True)
    held = []
    gc.collect()  # what is alive when the forward ends must not depend on when a collection last ran
    gc.disable()
    try:
        n = _step(loss_module, batch, opt, precision, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
                  lambda: held.append(sum(b for b, refs in saved.values() if any(r() is not None for r in refs))))
    finally:
        gc.enable()
    state = [t for st in opt.state.values() for t in st.values() if t.dim() > 0]
    counted = {"lora_params": sum(p.numel() * p.element_size() for p in trainable),
               "lora_grads": sum(p.grad.numel() * p.grad.element_size() for p in trainable),
               "adamw_states": sum(t.numel() * t.element_size() for t in state),
               "base_weights": sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)}
    batch_bytes = sum(t.numel() * t.element_size() for t in batch.values())
    peak = _profiled_peak(lambda: _step(loss_module, batch, opt, precision))
    return {"saved_bytes": held[0], "state": counted, "batch_bytes": batch_bytes,
            "step_peak": peak, "peak_bytes": sum(counted.values()) + batch_bytes + peak, "loss_tokens": n,
            "grids": [list(g) for e in examples for g in e.grids], "seq": max(len(e.input_ids) for e in examples),
            "lengths": [len(e.input_ids) for e in examples]}


def _profiled_peak(step) -> int:
    """The highest count of bytes allocated (and not yet freed) during ``step`` on the CPU, from the allocator's own
    events as torch's profiler records them."""
    from torch.profiler import ProfilerActivity, profile

    # Garbage of earlier work freed inside the window would count as negative bytes and lower the peak (seen in a
    # long pytest process): collect it first, and let no collection run during the step.
    gc.collect()
    gc.disable()
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            step()
    finally:
        gc.enable()
    live = peak = 0
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def patches(vision, grid) -> int:
    """The patches the tower sees for an image of ``grid`` (its rule's: Qwen's (t, h, w); SmolVLM's (rows, cols) of
    tiles and the global view; Gemma 3's, none: one view)."""
    if not vision.siglip:
        t, h, w = grid
        return t * h * w
    rows, cols = grid if grid else (0, 0)
    return (rows * cols + 1) * vision.view_patches


def predict(model_dir: Path, got: dict, b: int, precision: str, ckpt: bool):
    from rocktune.tasks.vlm.planner.vlm import VLMSpec, estimate_vlm, load_vlm_shape

    text, vision = load_vlm_shape(str(model_dir))
    tokens = [patches(vision, g) for g in got["grids"]]
    spec = VLMSpec(micro_batch=b, seq_len=got["seq"], patches=tuple(tokens), lora_r=8, precision=precision,
                   checkpointing=ckpt, device="cpu",
                   loss_fraction=got["loss_tokens"] / (b * (got["seq"] - 1)), padded=len(set(got["lengths"])) > 1)
    return estimate_vlm(text, vision, spec)


def run_point(folder: Path, name: str, width: int, height: int, b: int, precision: str, ckpt: bool) -> dict:
    """One grid point; the model directory is built once in ``folder``."""
    model_dir = folder / name if (folder / name / "config.json").is_file() else build_model_dir(folder, name)
    data = write_data(folder / f"{width}x{height}", width, height, b)
    got = measure(model_dir, data, b, precision, ckpt)
    est = predict(model_dir, got, b, precision, ckpt)
    terms = est.by_name()
    vision_sets_peak = terms["vision_forward"] > est.saved_bytes + est.peak_transient_bytes
    row = {"model": name, "size": f"{width}x{height}", "batch": b, "precision": precision, "checkpointing": ckpt,
           "peak_phase": "vision forward" if vision_sets_peak else "language model",
           "patches": est.vspec.total_patches, "seq": got["seq"],
           "saved_measured": got["saved_bytes"], "saved_predicted": est.saved_bytes,
           "peak_measured": got["peak_bytes"], "peak_predicted": est.peak_allocated}
    row["saved_error"] = (est.saved_bytes - got["saved_bytes"]) / got["saved_bytes"]
    row["peak_error"] = (est.peak_allocated - got["peak_bytes"]) / got["peak_bytes"]
    row["state_exact"] = all(terms[k] == v for k, v in got["state"].items())
    row["terms"] = terms
    return row


# The SigLIP towers alone (Gemma 3, SmolVLM): the frozen forward's CPU peak against the plan's vision_forward term, at
# two widths and a number of views (images or tiles) the step grid's tiny towers do not let set a step's peak
TOWERS = [(family, hidden, 34) for family in ("gemma3", "smolvlm") for hidden in (256, 512)]


def tower_point(folder: Path, family: str, hidden: int, views: int) -> dict:
    """The tower's forward (and its projector) on ``views`` random 32x32 views, its parameters frozen as task=vlm
    freezes them, under the profiler: the highest point of what it allocates, against ``vision_forward``."""
    import transformers

    from rocktune.tasks.vlm.demo.tiny_vlm_families import build_family_vlm
    from rocktune.tasks.vlm.planner.vlm import VLMSpec, estimate_vlm, load_vlm_shape

    model_dir = build_family_vlm(folder / f"tower-{family}-{hidden}", 0, family, vision_hidden=hidden, vision_depth=2)
    name = {"gemma3": "Gemma3", "smolvlm": "SmolVLM"}[family]
    model = getattr(transformers, f"{name}ForConditionalGeneration").from_pretrained(model_dir).requires_grad_(False)
    text, vision = load_vlm_shape(str(model_dir))
    pixels = torch.randn(views, 3, vision.view, vision.view)
    if family == "gemma3":
        run = lambda: model.model.get_image_features(pixels)  # noqa: E731
    else:  # one conversation of ``views`` tiles, none of them padding
        mask = torch.ones(1, views, vision.view, vision.view, dtype=torch.bool)
        run = lambda: model.model.get_image_features(pixels[None], mask)  # noqa: E731
    measured = _profiled_peak(run)
    spec = VLMSpec(seq_len=16, patches=(views * vision.view_patches,), device="cpu")
    predicted = estimate_vlm(text, vision, spec).by_name()["vision_forward"]
    return {"family": family, "hidden": hidden, "views": views, "patches": views * vision.view_patches,
            "measured": measured, "predicted": predicted, "error": (predicted - measured) / measured}


def run_grid(points=GRID) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="rocktune-vlm-plan-") as tmp:
        return [run_point(Path(tmp), *p) for p in points]


def markdown(rows: list[dict]) -> str:
    lines = ["| model | image | b | precision | ckpt | patches | tokens | saved measured | predicted | error "
             "| peak measured | predicted | error | peak set by |", "|---" * 14 + "|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['size']} | {r['batch']} | {r['precision']} "
                     f"| {'on' if r['checkpointing'] else 'off'} | {r['patches']} | {r['seq']} "
                     f"| {r['saved_measured']:,} | {r['saved_predicted']:,} "
                     f"| {r['saved_error']:+.1%} | {r['peak_measured']:,} | {r['peak_predicted']:,} "
                     f"| {r['peak_error']:+.1%} | {r['peak_phase']} |")
    return "\n".join(lines)


def tower_markdown(rows: list[dict]) -> str:
    lines = ["| tower | width | views | patches | forward peak measured | vision_forward | error |", "|---" * 7 + "|"]
    lines += [f"| {r['family']} | {r['hidden']} | {r['views']} | {r['patches']} | {r['measured']:,} "
              f"| {r['predicted']:,} | {r['error']:+.1%} |" for r in rows]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--markdown", action="store_true", help="print the table as markdown instead of JSON")
    args = ap.parse_args(argv)
    rows = run_grid()
    with tempfile.TemporaryDirectory(prefix="rocktune-vlm-tower-") as tmp:
        towers = [tower_point(Path(tmp), *t) for t in TOWERS]
    out = {"cpu": rows, "max_abs_saved_error": max(abs(r["saved_error"]) for r in rows),
           "max_abs_peak_error": max(abs(r["peak_error"]) for r in rows),
           "state_exact": all(r["state_exact"] for r in rows), "siglip_towers": towers}
    print(markdown(rows) + "\n\n" + tower_markdown(towers) if args.markdown else json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
