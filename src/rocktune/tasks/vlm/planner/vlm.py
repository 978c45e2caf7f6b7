"""Memory of one vision-language LoRA step (task=vlm: Qwen2.5-VL, Qwen3-VL, Qwen2-VL; Gemma 3, SmolVLM, Idefics3),
from config.json alone.

The language model is sized by the text planner (``estimate``) at the sequence length the image tokens make. The
vision side is frozen (LoRA on the language model, ``lora.vision: none``): its input needs no gradient and its weights
none either, so autograd saves nothing in the tower, and its activations exist only while it runs, one block at a
time, before the language model's forward starts. Its term is therefore a phase of its own (``vision``): the peak is
the larger of (static + the vision forward) and (static + saved + the largest transient), as the rollout of GRPO.
What the tower holds while it runs, per micro-batch of P patches (before the 2 x 2 merge) of width h:

- the residual stream (P x h) and the rotary tables (P x head_dim, fp32, cos and sin);
- the attention half of a block: the norm's fp32 copy, q/k/v, the rotated fp32 q and k with their temporaries, the
  output; eager attention adds the s x s fp32 scores of the largest chunk it attends at once: a whole image in a
  full-attention block, a window (``window_size`` pixels a side) in Qwen2.5-VL's windowed blocks; SDPA keeps no
  scores;
- the MLP half: the norm's output and the MLP's intermediates (gate, act, up and their product, or fc1 and GELU).

Gemma 3's, Idefics3's and SmolVLM's towers are SigLIP's (``_siglip_forward``): every view (a Gemma 3 image; an
Idefics3/SmolVLM tile or global image) is resized to the tower's one size, its patches attend to one another only, at
learned positions, and the projector pools (Gemma 3) or pixel-shuffles (SmolVLM) merge x merge patches into a token.

The pixels (fp32, P x channels x temporal x patch x patch) are part of the batch and live the whole step (the
``batch`` phase). Measured against real steps on the CPU in ``benchmarks/planner_validation_vlm.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cache

from rocktune.errors import UserError
from rocktune.planner.estimate import DTYPE_BYTES, FRAGMENTATION, MIB, Estimate, RunSpec, Term, estimate
from rocktune.planner.shapes import ModelShape, read_config, shape_from_config
# the families and their facts: the one table (standard library only), read live, so an entry added there is planned
from rocktune.tasks.vlm.vision.table import FAMILIES, PlanFacts


def facts(family: str) -> PlanFacts:
    """The planner's facts of a family of tasks/vlm/vision/table.py."""
    return FAMILIES[family].plan


def is_qwen(kind: str) -> bool:
    """Whether ``kind`` (a model_type, or its language model's ``<model_type>_text``) is a Qwen-VL family's that only
    task=vlm plans (Qwen3.5's language model is a text model too: its text plan stays)."""
    entry = FAMILIES.get(kind.removesuffix("_text"))
    return entry is not None and entry.plan.tower == "qwen" and not entry.text_task


@dataclass(frozen=True)
class VisionShape:
    family: str
    patch: int
    temporal_patch: int
    merge: int
    depth: int
    hidden: int
    intermediate: int
    heads: int
    out_hidden: int
    window: int  # pixels a side of a window-attention block (Qwen2.5-VL), 0: every block attends a whole image
    full_blocks: tuple[int, ...]  # blocks with full attention (Qwen2.5-VL); every block when window == 0
    in_channels: int = 3
    gated: bool = True  # Qwen2.5-VL's SwiGLU MLP (gate, up, down); Qwen2-VL's and Qwen3-VL's fc1 -> GELU -> fc2
    model_params: int = 0  # the whole model's parameters (language model, vision tower, projector), counted
    view: int = 0  # SigLIP towers: pixels a side of the one size every view is resized to (0: Qwen's own grid)

    @property
    def siglip(self) -> bool:
        return self.view > 0

    @property
    def view_patches(self) -> int:
        """Patches of one view (a Gemma 3 image, an Idefics3/SmolVLM tile or global image): one attention chunk."""
        return (self.view // self.patch) ** 2

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def factor(self) -> int:
        """Pixels a side of one image token: images are resized to multiples of it (the processor's smart resize)."""
        return self.patch * self.merge

    @property
    def patch_values(self) -> int:
        return self.in_channels * self.temporal_patch * self.patch * self.patch

    @property
    def window_patches(self) -> int:
        return (self.window // self.patch) ** 2 if self.window else 0


def vision_shape(config: dict, name: str = "config") -> VisionShape:
    """The vision tower's sizes from a vision-language config.json (its ``vision_config``)."""
    family = config.get("model_type")
    v = config.get("vision_config")
    if family not in FAMILIES or not isinstance(v, dict):
        raise UserError(f"{name}: task=vlm plans {', '.join(FAMILIES)} models (a config.json with a vision_config); "
                        f"this one has model_type {family!r}.")
    plan = facts(family)
    if plan.tower == "siglip":
        return _siglip_shape(config, v, name)
    if plan.embed_dim:  # Qwen2-VL names the tower's width embed_dim; its hidden_size is the projector's output
        hidden, intermediate = v.get("embed_dim", 1280), v.get("embed_dim", 1280) * v.get("mlp_ratio", 4)
        out = v.get("hidden_size", 3584)
    else:
        hidden, intermediate, out = v.get("hidden_size"), v.get("intermediate_size"), v.get("out_hidden_size")
    depth = v.get("depth", 32)
    values = {"hidden_size": hidden, "intermediate_size": intermediate, "out_hidden_size": out, "depth": depth,
              "num_heads": v.get("num_heads", 16)}
    bad = [k for k, x in values.items() if not isinstance(x, int) or x <= 0]
    if bad:
        raise UserError(f"{name}: vision_config lacks a positive {', '.join(bad)}; pass the model's own config.json.")
    window = v.get("window_size", 112) if plan.windows else 0
    full = tuple(v.get("fullatt_block_indexes", (7, 15, 23, 31))) if window else tuple(range(depth))
    return VisionShape(family, v.get("patch_size", 14), v.get("temporal_patch_size", 2), v.get("spatial_merge_size", 2),
                       depth, hidden, intermediate, values["num_heads"], out, window, full,
                       v.get("in_channels", 3), gated=plan.gated)


def _siglip_shape(config: dict, v: dict, name: str) -> VisionShape:
    """Gemma 3's tower pools each image's patches to mm_tokens_per_image soft tokens (an average over k x k patches);
    Idefics3's and SmolVLM's connector shuffles scale_factor x scale_factor patches into one token: either way one
    token stands for merge x merge patches of a view."""
    keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "image_size",
            "patch_size")
    bad = [k for k in keys if not isinstance(v.get(k), int) or v[k] <= 0]
    if bad:
        raise UserError(f"{name}: vision_config lacks a positive {', '.join(bad)}; pass the model's own config.json.")
    side = v["image_size"] // v["patch_size"]
    if facts(config["model_type"]).pooled:
        merge = side // int(config.get("mm_tokens_per_image", 256) ** 0.5)
        out = config.get("text_config", {}).get("hidden_size")
    else:
        merge = config.get("scale_factor", 2)
        out = config.get("text_config", {}).get("hidden_size")
    depth = v["num_hidden_layers"]
    return VisionShape(config["model_type"], v["patch_size"], 1, merge, depth, v["hidden_size"],
                       v["intermediate_size"], v["num_attention_heads"], out or 0, 0, tuple(range(depth)),
                       v.get("num_channels", 3), gated=False, view=v["image_size"])


def is_vlm_config(model: str) -> bool:
    """Whether ``model`` (a directory or config.json) is a vision-language model only the vlm task plans (a family
    the text tasks train too, Qwen3.5, is planned as text unless --task vlm asks)."""
    kind = vlm_model_type(model)
    return kind is not None and not FAMILIES[kind].text_task


def vlm_model_type(model: str) -> str | None:
    """The model_type of ``model`` when it is a vision-language model of the families task=vlm trains, else None.
    ``model``: a model directory, its config.json, or a hub id whose config.json is in the local hub cache (nothing
    is downloaded: an id not yet cached answers None, and the loader refuses it later). The top-level model_type
    decides, since the language model's (gemma3_text, llama) is also a text model's. ``plan``, ``train``,
    ``data preview`` and ``generate`` all ask this one question."""
    from pathlib import Path

    path = Path(model).expanduser()
    path = path / "config.json" if path.is_dir() else path
    if not path.is_file():
        path = _cached_hub_config(model)
        if path is None:
            return None
    config = read_config(path)
    kind = config.get("model_type")
    return kind if kind in FAMILIES and isinstance(config.get("vision_config"), dict) else None


def _cached_hub_config(repo_id: str):
    """The hub cache's copy of ``repo_id``'s config.json, or None (not an id, or not cached)."""
    from pathlib import Path

    if repo_id.count("/") > 1 or repo_id.startswith((".", "/", "~")):
        return None
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(repo_id, "config.json")
    except (ImportError, ValueError):  # not a valid repo id: the loader says so in its own words
        return None
    return Path(found) if isinstance(found, str) else None


def load_vlm_shape(model: str) -> tuple[ModelShape, VisionShape]:
    """(the language model's shape, the vision tower's) of a model directory or config.json, with the whole model's
    parameters counted by transformers on the meta device (no weights are read or allocated)."""
    from pathlib import Path

    path = Path(model).expanduser()
    path = path / "config.json" if path.is_dir() else path
    if not path.is_file():
        raise UserError(f"{model}: task=vlm plans from a model directory (or its config.json); no file {path}.")
    config = read_config(path)
    vision = vision_shape(config, str(path))
    return shape_from_config(config, str(path)), replace(vision, model_params=_count_params(str(path.parent)))


@cache
def _count_params(model_dir: str) -> int:
    import torch
    import transformers
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    cls = getattr(transformers, FAMILIES[config.model_type].model_class)
    with torch.device("meta"):
        model = cls._from_config(config)
    return sum(p.numel() for p in model.parameters())


@dataclass(frozen=True)
class VLMSpec:
    """One vision-language micro-batch as the planner sizes it."""

    micro_batch: int = 1
    seq_len: int = 1024  # tokens of the longest conversation, its image tokens included (rows are padded to it)
    patches: tuple[int, ...] = ()  # patches (before the merge) of each image in the micro-batch
    lora_r: int = 8
    precision: str = "fp32"
    checkpointing: bool = False
    attn: str = "sdpa"  # sdpa (task=vlm's) | eager: s x s scores in the vision tower too
    device: str = "gpu"
    loss_fraction: float = 1.0
    padded: bool | None = None
    loss_chunk: int = 256

    @property
    def total_patches(self) -> int:
        return sum(self.patches)


@dataclass
class VLMEstimate(Estimate):
    vision: VisionShape | None = None
    vspec: VLMSpec = field(default_factory=VLMSpec)


def estimate_vlm(text: ModelShape, vision: VisionShape, spec: VLMSpec) -> VLMEstimate:
    """The text planner's estimate at ``spec.seq_len``, with the whole model's weights, the pixels of the batch and
    the frozen vision tower's forward."""
    if spec.precision not in DTYPE_BYTES:
        raise UserError(f"precision must be one of {', '.join(DTYPE_BYTES)}, not {spec.precision!r}.")
    # Gemma 3's image tokens attend to one another both ways: its masks are never the plain causal one, so every
    # layer converts one to float for sdpa (and repeats k/v), as with padding
    padded = True if facts(vision.family).bidirectional else spec.padded
    run = RunSpec(micro_batch=spec.micro_batch, seq_len=spec.seq_len, lora_r=spec.lora_r, precision=spec.precision,
                  attn=spec.attn, checkpointing=spec.checkpointing, loss_fraction=spec.loss_fraction,
                  padded=padded, device=spec.device, loss_chunk=spec.loss_chunk)
    lm = estimate(text, run)
    est = VLMEstimate(text, run, vision=vision, vspec=spec)
    dt = DTYPE_BYTES[spec.precision]
    for t in lm.terms:
        if t.phase == "overhead":
            continue
        # Qwen's 3-D positions: cos/sin per row, not shared
        if t.name == "final_norm_rope" and spec.micro_batch > 1 and not vision.siglip:
            extra = (spec.micro_batch - 1) * 2 * spec.seq_len * text.head_dim * dt
            t = Term(t.name, t.bytes + extra, t.phase, t.inputs + " (one per row: Qwen's 3-D positions)")
        if t.name == "base_weights":
            t = Term(t.name, vision.model_params * dt, "static", f"{vision.model_params:,} params (language model "
                     f"{text.n_params:,}, vision tower and projector {vision.model_params - text.n_params:,}) x {dt} B")
        est.terms.append(t)

    def add(name, n, phase, inputs):
        est.terms.append(Term(name, int(n), phase, inputs))
    if facts(vision.family).bidirectional:  # Gemma 3: its sliding layers' own rotary tables (a second base), kept
        #                                     for the backward
        add("local_rope", 2 * spec.seq_len * text.head_dim * 4, "saved", "cos and sin of the local rotary base "
            f"(sliding-window layers): 2 x {spec.seq_len} x {text.head_dim} x 4 B")
        if spec.checkpointing and spec.attn != "eager":  # the sliding layers' own bool mask, beside the global one
            add("sliding_mask", spec.micro_batch * spec.seq_len**2, "saved", "the sliding-window layers' 4-D mask, "
                "kept by their checkpoints (1 B a pair)")
    _batch(vision, spec, add)
    (_siglip_forward if vision.siglip else _vision_forward)(vision, spec, dt, add)
    dynamic = max(est.saved_bytes + est.peak_transient_bytes, est.phase("vision"))
    add("allocator_overhead", FRAGMENTATION * dynamic + 64 * MIB, "overhead",
        f"{FRAGMENTATION:.0%} of activations + transients + 64 MiB for block rounding and fragmentation")
    add("device_context", lm.by_name()["device_context"], "overhead",
        next(t.inputs for t in lm.terms if t.name == "device_context"))
    return est


def _pixel_values(vision: VisionShape, patches: int) -> int:
    """Values of the pixels of ``patches`` patches: a SigLIP view's whole square (SmolVLM's 384 pixels hold 27 whole
    patches of 14 a side, the rest cut by the convolution), Qwen's patches exactly."""
    if vision.siglip:
        return patches // vision.view_patches * vision.in_channels * vision.view**2
    return patches * vision.patch_values


def _batch(vision: VisionShape, spec: VLMSpec, add) -> None:
    p, rows = spec.total_patches, spec.micro_batch * spec.seq_len
    values = _pixel_values(vision, p)
    add("pixel_values", values * 4, "batch",
        f"{len(spec.patches)} image(s), {p:,} patches, {values:,} values x 4 B (fp32, the processor's)")
    tiles = vision.siglip and not facts(vision.family).pooled
    if tiles:
        add("pixel_attention_mask", values // vision.in_channels, "batch", "1 B a pixel of each view (bool)")
    kinds = 3 if tiles else 4
    add("token_rows", kinds * rows * 8, "batch", f"ids, mask, labels{', token types' if kinds == 4 else ''}: "
        f"{spec.micro_batch} x {spec.seq_len} x 8 B each")


def _siglip_forward(vision: VisionShape, spec: VLMSpec, dt: int, add) -> None:
    """A SigLIP tower (Gemma 3, Idefics3, SmolVLM): each view's patches attend to one another only, at learned
    positions (no rotary tables); LayerNorm, q/k/v/out with biases, fc1 -> GELU -> fc2."""
    p, h, i = spec.total_patches, vision.hidden, vision.intermediate
    if not p:
        return
    views = p // vision.view_patches
    cast = _pixel_values(vision, p) * dt if dt != 4 else 0
    if not facts(vision.family).pooled:  # the real views gathered out of the padded (conversations, images) batch
        cast += _pixel_values(vision, p) * 4
    # the residual, the block's input and its norm's output; measured with torch's profiler on the tiny towers
    # (widths 256 and 512): Gemma 3's forward peaks at 8.0 x P x h x 4 B, SmolVLM's at 8.4-8.8 (its pixels gathered)
    stream = 3 * p * h * dt
    attention = p * h * 5 * dt  # q, k, v, attention out, out projection
    scores = views * vision.heads * vision.view_patches**2 * 4 if spec.attn == "eager" else 0
    mlp = p * (h + 2 * i) * dt  # fc1, GELU, fc2
    tokens = p // vision.merge**2
    add("vision_forward", cast + stream + max(attention + scores, mlp) + tokens * vision.out_hidden * dt, "vision",
        f"frozen SigLIP tower, one block at a time: {views} view(s) of {vision.view_patches} patches, {p:,} x {h} "
        f"wide; max(attention {(attention + scores) / MIB:.1f} MiB, MLP {mlp / MIB:.1f} MiB); projected output "
        f"{tokens:,} tokens x {vision.out_hidden}")


def _vision_forward(vision: VisionShape, spec: VLMSpec, dt: int, add) -> None:
    p, h, i, hd = spec.total_patches, vision.hidden, vision.intermediate, vision.head_dim
    if not p:
        return
    cast = p * vision.patch_values * dt if dt != 4 else 0  # the pixels cast to the tower's dtype
    stream = p * h * dt + 2 * p * hd * 4  # residual + fp32 rotary tables
    attention = p * h * (4 * dt + 6 * 4)  # norm out, qkv, attention out; fp32 q, k rotated with their temporaries
    chunk = max(spec.patches) if vision.full_blocks else vision.window_patches
    scores = vision.heads * chunk * chunk * 4 if spec.attn == "eager" else 0
    mlp = p * (h * dt + (3 if vision.gated else 2) * i * dt)
    merged = p // vision.merge**2 * vision.out_hidden * dt
    kind = "full" if vision.full_blocks else "window"
    add("vision_forward", cast + stream + max(attention + scores, mlp) + merged, "vision",
        f"frozen tower, one block at a time: {p:,} patches x {h} wide, residual + rotary; max(attention "
        f"{(attention + scores) / MIB:.1f} MiB ({kind} attention, largest chunk {chunk} patches), MLP "
        f"{mlp / MIB:.1f} MiB); merged output {p // vision.merge**2:,} tokens x {vision.out_hidden}")
