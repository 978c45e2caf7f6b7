"""Memory of one vision-language LoRA step (task=vlm: Qwen2.5-VL, Qwen3-VL, Qwen2-VL), from config.json alone.

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

The pixels (fp32, P x channels x temporal x patch x patch) are part of the batch and live the whole step (the
``batch`` phase). Measured against real steps on the CPU in ``benchmarks/planner_validation_vlm.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import cache

from rocktune.errors import UserError
from rocktune.planner.estimate import DTYPE_BYTES, FRAGMENTATION, MIB, Estimate, RunSpec, Term, estimate
from rocktune.planner.shapes import ModelShape, read_config, shape_from_config

FAMILIES = ("qwen2_5_vl", "qwen3_vl", "qwen2_vl")


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
    if family == "qwen2_vl":  # Qwen2-VL names the tower's width embed_dim; its hidden_size is the projector's output
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
    window = v.get("window_size", 112) if family == "qwen2_5_vl" else 0
    full = tuple(v.get("fullatt_block_indexes", (7, 15, 23, 31))) if window else tuple(range(depth))
    return VisionShape(family, v.get("patch_size", 14), v.get("temporal_patch_size", 2), v.get("spatial_merge_size", 2),
                       depth, hidden, intermediate, values["num_heads"], out, window, full,
                       v.get("in_channels", 3), gated=family == "qwen2_5_vl")


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
    # (vision_model.FAMILIES says the same; the planner does not import the model layer, which imports the data's)
    cls = getattr(transformers, {"qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
                                 "qwen3_vl": "Qwen3VLForConditionalGeneration",
                                 "qwen2_vl": "Qwen2VLForConditionalGeneration"}[config.model_type])
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


def estimate_vlm(text: ModelShape, vision: VisionShape, spec: VLMSpec) -> Estimate:
    """The text planner's estimate at ``spec.seq_len``, with the whole model's weights, the pixels of the batch and
    the frozen vision tower's forward."""
    if spec.precision not in DTYPE_BYTES:
        raise UserError(f"precision must be one of {', '.join(DTYPE_BYTES)}, not {spec.precision!r}.")
    run = RunSpec(micro_batch=spec.micro_batch, seq_len=spec.seq_len, lora_r=spec.lora_r, precision=spec.precision,
                  attn=spec.attn, checkpointing=spec.checkpointing, loss_fraction=spec.loss_fraction,
                  padded=spec.padded, device=spec.device, loss_chunk=spec.loss_chunk)
    lm = estimate(text, run)
    est = VLMEstimate(text, run, vision=vision, vspec=spec)
    dt = DTYPE_BYTES[spec.precision]
    for t in lm.terms:
        if t.phase == "overhead":
            continue
        if t.name == "final_norm_rope" and spec.micro_batch > 1:  # 3-D positions: cos/sin per row, not shared
            extra = (spec.micro_batch - 1) * 2 * spec.seq_len * text.head_dim * dt
            t = Term(t.name, t.bytes + extra, t.phase, t.inputs + " (one per row: Qwen's 3-D positions)")
        if t.name == "base_weights":
            t = Term(t.name, vision.model_params * dt, "static", f"{vision.model_params:,} params (language model "
                     f"{text.n_params:,}, vision tower and projector {vision.model_params - text.n_params:,}) x {dt} B")
        est.terms.append(t)

    def add(name, n, phase, inputs):
        est.terms.append(Term(name, int(n), phase, inputs))
    _batch(vision, spec, add)
    _vision_forward(vision, spec, dt, add)
    dynamic = max(est.saved_bytes + est.peak_transient_bytes, est.phase("vision"))
    add("allocator_overhead", FRAGMENTATION * dynamic + 64 * MIB, "overhead",
        f"{FRAGMENTATION:.0%} of activations + transients + 64 MiB for block rounding and fragmentation")
    add("device_context", lm.by_name()["device_context"], "overhead",
        next(t.inputs for t in lm.terms if t.name == "device_context"))
    return est


def _batch(vision: VisionShape, spec: VLMSpec, add) -> None:
    p, rows = spec.total_patches, spec.micro_batch * spec.seq_len
    add("pixel_values", p * vision.patch_values * 4, "batch",
        f"{len(spec.patches)} image(s), {p:,} patches x {vision.patch_values} values x 4 B (fp32, the processor's)")
    add("token_rows", 4 * rows * 8, "batch", f"ids, mask, labels, token types: {spec.micro_batch} x {spec.seq_len} x "
        "8 B each")


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


# --- the fit: the largest resolution, then the fastest micro-batch and checkpointing --------------------------------

# What a resolution gives one micro-batch: (max_pixels, micro_batch) -> (tokens of its longest conversation, the
# patches of each of its images, the most loss-bearing tokens of a conversation). The caller derives it from the data
# (or an assumed image) and the processor.
Sizes = Callable[[int, int], tuple[int, tuple[int, ...], int]]


def sized(base: VLMSpec, sizes: Sizes, max_pixels: int, micro_batch: int, checkpointing: bool) -> VLMSpec:
    seq, patches, loss = sizes(max_pixels, micro_batch)
    return replace(base, micro_batch=micro_batch, seq_len=seq, patches=patches, checkpointing=checkpointing,
                   loss_fraction=min(1.0, loss / max(1, seq - 1)))


@dataclass
class VLMFit:
    max_pixels: int
    micro_batch_size: int
    grad_accum: int
    gradient_checkpointing: bool
    seq_len: int  # tokens of the longest conversation at max_pixels
    image_tokens: int  # of the micro-batch's images at max_pixels
    predicted_peak_bytes: int
    total_bytes: int
    budget_bytes: int
    reasons: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Resolution:
    """The pixel limits a fit may choose from: ``max_pixels`` is the most asked for (the config's, or the processor's
    own), lowered in steps of one token's pixels (``VisionShape.factor`` squared), never below ``min_pixels``."""

    max_pixels: int
    min_pixels: int


def fit_vlm(text: ModelShape, vision: VisionShape, base: VLMSpec, sizes: Sizes, limits: Resolution,
            budget: tuple[int, str], global_batch: int) -> VLMFit:
    """The largest max_pixels at which some micro-batch (a divisor of ``global_batch``) with or without
    checkpointing fits ``budget`` (bytes, where the figure came from; ``MARGIN`` kept free), then the fastest
    setting at it. A resolution is worth more than speed: the micro-batch is chosen second."""
    from rocktune.planner.fit import MARGIN

    usable = int(budget[0] * (1 - MARGIN))
    unit = vision.factor**2
    micro = [d for d in range(1, max(1, global_batch) + 1) if global_batch % d == 0]

    def candidates(n: int) -> list[Estimate]:
        out = []
        for m in micro:
            for ckpt in (False, True):
                out.append(estimate_vlm(text, vision, sized(base, sizes, n * unit, m, ckpt)))
        return out

    def fits(n: int) -> list[Estimate]:
        return [e for e in candidates(n) if e.total_bytes <= usable]

    hi, lo = limits.max_pixels // unit, max(1, -(-limits.min_pixels // unit))
    if hi < lo:
        raise UserError(f"data.max_pixels={limits.max_pixels} is below min_pixels={limits.min_pixels} (one token is "
                        f"{vision.factor}x{vision.factor} pixels); raise data.max_pixels.")
    if not fits(lo):
        smallest = min(candidates(lo), key=lambda e: e.total_bytes)
        raise UserError(f"{text.name} does not fit in {_gib(budget[0])} ({budget[1]}) even at max_pixels={lo * unit} "
                        f"(the lowest above min_pixels={limits.min_pixels}) with micro-batch 1 and checkpointing: it "
                        f"needs {_gib(smallest.total_bytes)}, so a budget of at least "
                        f"{_gib(smallest.total_bytes / (1 - MARGIN))} would work. Lower data.min_pixels or "
                        "data.max_length, or use a smaller model.")
    best = hi if fits(hi) else _largest(lo, hi, lambda n: bool(fits(n)))
    from rocktune.planner.fit import throughput

    chosen = max(fits(best), key=throughput)
    s, vs = chosen.spec, chosen.vspec
    why = (f"data.max_pixels={best * unit} (at most {best} tokens per image, {best} x {vision.factor}x{vision.factor} "
           f"pixels), micro-batch {s.micro_batch}, checkpointing {'on' if s.checkpointing else 'off'}: the longest "
           f"conversation {s.seq_len} tokens, {vs.total_patches // vision.merge**2} image tokens in the micro-batch; "
           f"needs {_gib(chosen.total_bytes)} of {_gib(budget[0])} ({budget[1]}, {MARGIN:.0%} kept free)")
    reasons = [f"chosen: {why}"]
    if best < hi:
        over = min(candidates(best + 1), key=lambda e: e.total_bytes)
        reasons.append(f"max_pixels={(best + 1) * unit} (one token more per image) does not fit with any micro-batch "
                       f"or checkpointing: the smallest needs {over.total_bytes / 2**20:,.1f} MiB > "
                       f"{usable / 2**20:,.1f} MiB usable")
    else:
        reasons.append(f"the asked max_pixels={limits.max_pixels} fits: the resolution is kept")
    return VLMFit(best * unit, s.micro_batch, global_batch // s.micro_batch, s.checkpointing, s.seq_len,
                  vs.total_patches // vision.merge**2, chosen.peak_allocated, chosen.total_bytes, budget[0], reasons)


def _largest(lo: int, hi: int, ok) -> int:
    """The largest n in [lo, hi] with ok(n), given ok(lo) and that ok holds below any n where it holds."""
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid - 1)
    return lo


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"
