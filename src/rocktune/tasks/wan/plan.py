"""Memory of one Wan LoRA training step (diffusers ``WanTransformer3DModel`` + PEFT), from config.json alone.

Covers the transformer only: latents and text embeddings are inputs of the step (the VAE and the UMT5 encoder are
not resident in it). Each saved-for-backward term follows what diffusers, PEFT and torch save, measured tensor by
tensor with ``saved_tensors_hooks`` in ``benchmarks/planner_validation_wan.py``. The rules that matter:

- the frozen base saves nothing for its own weights; each LoRA ``lora_A`` saves its input and ``lora_B`` its
  rank-``r`` input. In fp32, adapters on the same input share it (the attention output is the ``to_out`` input);
  under bf16 (or fp16) autocast PEFT casts the input to fp32 and autocast back, so every adapter saves its own bf16
  copy and bf16 copies of A and B.
- the FP32 LayerNorms (norm1, norm2, norm3, norm_out) and the q/k RMSNorms save an fp32 input and per-token stats
  whatever the precision; the first block's norm1 saves nothing (its input needs no gradient).
- attention saves q, k, v, the output and an fp32 log-sum-exp per head and query; cross-attention's k and v have the
  text length. The rotary tables (fp32, per sample) are saved once.
- gradient checkpointing keeps each block's input plus the shared text states, timestep projection and rotary
  tables; one block is recomputed during backward.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from functools import cache
from pathlib import Path

from rocktune.errors import UserError
from rocktune.planner.budget import detect_budget, parse_budget
from rocktune.planner.estimate import CONTEXT, DTYPE_BYTES, FRAGMENTATION, MIB, Term, TermSums
from rocktune.planner.fit import MARGIN
from rocktune.planner.report import fmt_bytes, yes_no
from rocktune.planner.shapes import read_config

# What training wraps with LoRA (peft fullmatches a string against each module name).
LORA_TARGETS = r"blocks\.\d+\.(attn1|attn2)\.(to_q|to_k|to_v|to_out\.0)|blocks\.\d+\.ffn\.net\.(0\.proj|2)"
REQUIRED = ("num_attention_heads", "attention_head_dim", "ffn_dim", "num_layers", "in_channels", "text_dim")


@dataclass(frozen=True)
class WanShape:
    name: str
    layers: int
    heads: int
    head_dim: int
    ffn: int
    in_channels: int
    out_channels: int
    text_dim: int
    freq_dim: int
    patch: tuple[int, int, int]
    cross_attn_norm: bool
    rope_max_seq_len: int
    vae_spatial: int
    vae_temporal: int

    @property
    def dim(self) -> int:
        return self.heads * self.head_dim

    def linears(self) -> list[tuple[str, int, int, bool]]:
        """LoRA-targeted linears of one block as (name, in, out, reads the text states)."""
        d = self.dim
        attn = [(f"{a}.{p}", d, d, a == "attn2" and p in ("to_k", "to_v"))
                for a in ("attn1", "attn2") for p in ("to_q", "to_k", "to_v", "to_out.0")]
        return attn + [("ffn.net.0.proj", d, self.ffn, False), ("ffn.net.2", self.ffn, d, False)]

    def param_counts(self) -> dict[str, int]:
        d, f, patch = self.dim, self.ffn, math.prod(self.patch)
        block = 8 * (d * d + d) + 4 * d + (2 * d if self.cross_attn_norm else 0) + 2 * d * f + f + d + 6 * d
        return {"patch_embedding": self.in_channels * patch * d + d,
                "condition_embedder": self._time_embedder() + 6 * d * d + 6 * d + self.text_dim * d + d + d * d + d,
                "blocks": self.layers * block,
                "head": d * self.out_channels * patch + self.out_channels * patch + 2 * d}

    def _time_embedder(self) -> int:
        return self.freq_dim * self.dim + self.dim + self.dim * self.dim + self.dim

    def fp32_params(self) -> int:
        """Parameters diffusers keeps in fp32 when loading in bf16 (``_keep_in_fp32_modules``): the time embedder,
        the modulation tables and norm2's affine weights."""
        d = self.dim
        return self._time_embedder() + self.layers * (6 * d + (2 * d if self.cross_attn_norm else 0)) + 2 * d

    @property
    def n_params(self) -> int:
        return sum(self.param_counts().values())

    def latent_grid(self, width: int, height: int, frames: int) -> tuple[int, int, int]:
        """Tokens per sample along (frames, height, width) after the VAE and the patch embedding."""
        p_t, p_h, p_w = self.patch
        step = self.vae_spatial * max(p_h, p_w)
        if width % step or height % step or min(width, height) < step:
            raise UserError(f"resolution {width}x{height} does not fit {self.name}: width and height must be "
                            f"multiples of {step} (VAE factor {self.vae_spatial} x patch {p_h}); e.g. 832x480.")
        if frames < 1 or (frames - 1) % self.vae_temporal:
            raise UserError(f"frames={frames} does not fit the VAE: a frame count must be {self.vae_temporal}k+1 "
                            "(1, 5, 9, ..., 33, 49, 81).")
        return ((frames - 1) // self.vae_temporal + 1) // p_t, height // self.vae_spatial // p_h, \
            width // self.vae_spatial // p_w


@dataclass
class WanEstimate(TermSums):
    shape: WanShape
    settings: dict
    tokens: int  # latent tokens of the micro-batch
    terms: list[Term] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        """Predicted peak allocated in a training step (compare with torch.cuda.max_memory_allocated)."""
        return self.phase("static") + self.saved_bytes + self.peak_transient_bytes

    @property
    def reserved_bytes(self) -> int:
        """What the device must hold: the peak plus allocator overhead and the device context."""
        return self.total_bytes + self.phase("overhead")


@cache
def presets() -> dict[str, dict]:
    data = json.loads(Path(__file__).with_name("wan_presets.json").read_text())
    return {k: v for k, v in data.items() if not k.startswith("_")}


def load_wan_shape(model: str) -> WanShape:
    """``model``: a diffusers Wan directory (with ``transformer/`` and ``vae/``), a transformer directory, or a preset
    hub id such as ``Wan-AI/Wan2.1-T2V-1.3B-Diffusers``."""
    path = Path(model).expanduser()
    if path.is_dir():
        config_path = path / "transformer" / "config.json"
        if not config_path.is_file():
            config_path = path / "config.json"
        if not config_path.is_file():
            raise UserError(f"{model} has no transformer/config.json (nor config.json): pass a diffusers Wan "
                            "directory with model_index.json, or a preset such as Wan-AI/Wan2.1-T2V-1.3B-Diffusers.")
        vae = read_config(path / "vae" / "config.json") if (path / "vae" / "config.json").is_file() else {}
        # AutoencoderKLWan's defaults when its config leaves them out, as WanPipeline reads them
        factors = (vae.get("scale_factor_spatial") or 8, vae.get("scale_factor_temporal") or 4)
        return shape_from_config(read_config(config_path), factors, str(config_path))
    key = next((k for k in presets() if k.lower() == model.rsplit("/", 1)[-1].lower()), None)
    if key is None:
        raise UserError(f"unknown Wan model {model!r}: not a local diffusers directory and not a preset. Known "
                        f"presets: {', '.join('Wan-AI/' + k for k in presets())}.")
    config = presets()[key]
    return shape_from_config(config, (config["vae_scale_factor_spatial"], config["vae_scale_factor_temporal"]), key)


def shape_from_config(config: dict, vae_factors: tuple[int, int] = (8, 4), name: str = "config") -> WanShape:
    missing = [k for k in REQUIRED if not isinstance(config.get(k), int) or config[k] <= 0]
    if missing:
        raise UserError(f"{name}: not a WanTransformer3DModel config: {', '.join(missing)} missing or not a positive "
                        "integer.")
    if config.get("added_kv_proj_dim") or config.get("image_dim"):
        raise UserError(f"{name}: an image-to-video Wan transformer (added_kv_proj_dim/image_dim set); the planner "
                        "and video-lora cover the text-to-video checkpoints.")
    return WanShape(
        name=name, layers=config["num_layers"], heads=config["num_attention_heads"],
        head_dim=config["attention_head_dim"], ffn=config["ffn_dim"], in_channels=config["in_channels"],
        out_channels=config.get("out_channels") or config["in_channels"], text_dim=config["text_dim"],
        freq_dim=config.get("freq_dim", 256), patch=tuple(config.get("patch_size", (1, 2, 2))),
        cross_attn_norm=bool(config.get("cross_attn_norm", True)),
        rope_max_seq_len=config.get("rope_max_seq_len", 1024), vae_spatial=vae_factors[0],
        vae_temporal=vae_factors[1])


def lora_param_count(shape: WanShape, r: int) -> int:
    return shape.layers * sum(r * (n_in + n_out) for _, n_in, n_out, _ in shape.linears())


@dataclass(frozen=True)
class WanSpec:
    """One Wan LoRA step as the planner sizes it (the Wan counterpart of ``RunSpec``)."""

    width: int
    height: int
    frames: int  # 4k+1 (1 for an image)
    batch: int = 1
    text_tokens: int = 512  # what WanPipeline and training pad the prompt to
    lora_r: int = 16
    precision: str = "bf16"
    checkpointing: bool = False


def estimate_wan(shape: WanShape, spec: WanSpec) -> WanEstimate:
    width, height, frames, batch = spec.width, spec.height, spec.frames, spec.batch
    text_tokens, lora_r, precision, gradient_checkpointing = spec.text_tokens, spec.lora_r, spec.precision, \
        spec.checkpointing
    if precision not in DTYPE_BYTES:
        raise UserError(f"precision {precision!r} is not supported for Wan LoRA: use one of {', '.join(DTYPE_BYTES)}.")
    if min(batch, text_tokens, lora_r) < 1:
        raise UserError("batch, text tokens and LoRA rank must be positive integers.")
    per_sample = math.prod(shape.latent_grid(width, height, frames))
    sizes = _Sizes(shape, batch * per_sample, batch * text_tokens, batch, lora_r, DTYPE_BYTES[precision])
    est = WanEstimate(shape, {"width": width, "height": height, "frames": frames, "batch": batch,
                              "text_tokens": text_tokens, "lora_r": lora_r, "precision": precision,
                              "gradient_checkpointing": gradient_checkpointing}, sizes.t)

    def add(name: str, n: float, phase: str, inputs: str) -> None:
        est.terms.append(Term(name, int(n), phase, inputs))

    _static(shape, sizes, add)
    _saved(shape, sizes, per_sample, gradient_checkpointing, add)
    _transients(shape, sizes, gradient_checkpointing, add)
    dynamic = est.saved_bytes + est.peak_transient_bytes
    add("allocator_overhead", FRAGMENTATION * dynamic + 64 * MIB, "overhead",
        f"{FRAGMENTATION:.0%} of activations + transients + 64 MiB for block rounding and fragmentation")
    add("device_context", CONTEXT["gpu"], "overhead", "CUDA/HIP context + BLAS workspaces")
    return est


@dataclass(frozen=True)
class _Sizes:
    shape: WanShape
    t: int  # latent tokens in the micro-batch
    c: int  # text tokens in the micro-batch
    b: int
    r: int
    dt: int  # activation bytes: 4 (fp32) or 2 (bf16 autocast)

    @property
    def amp(self) -> bool:
        return self.dt != 4

    def norm(self, tokens: int, width: int, stats: int = 2) -> int:
        """An fp32 LayerNorm/RMSNorm: its fp32 input and ``stats`` per-token fp32 values."""
        return tokens * (4 * width + 4 * stats)


def _static(shape: WanShape, s: _Sizes, add) -> None:
    n = shape.n_params
    if s.amp:
        kept = shape.fp32_params()
        add("base_weights", (n - kept) * 2 + kept * 4, "static",
            f"{n - kept:,} params x 2 B (bf16) + {kept:,} kept in fp32 by diffusers (time embedder, modulation, norm2)")
    else:
        add("base_weights", n * 4, "static", f"{n:,} params x 4 B (fp32)")
    lora = lora_param_count(shape, s.r)
    add("lora_params", lora * 4, "static", f"{lora:,} params (r={s.r} on attn1/attn2 q,k,v,out + FFN) x 4 B fp32")
    add("lora_grads", lora * 4, "static", f"{lora:,} fp32 gradients (the frozen base gets none)")
    add("adamw_states", lora * 8, "static", f"{lora:,} x 2 fp32 AdamW states")
    # The latent feed's fp32 latents, noise, velocity target and text states, and the copies cast for the model.
    lat = s.t * math.prod(shape.patch) * shape.in_channels
    io = lat * (3 * 4 + s.dt) + s.c * shape.text_dim * (4 + s.dt)
    add("batch_inputs", io, "static", f"latents, noise, target ({lat:,} x 4 B each) + text states {s.c:,} x "
        f"{shape.text_dim} x 4 B, and their {s.dt}-byte copies for the transformer")


def block_saved(shape: WanShape, s: _Sizes, first: bool) -> dict[str, int]:
    """Saved-for-backward bytes of one transformer block, by part."""
    t, c, d, f, dt = s.t, s.c, shape.dim, shape.ffn, s.dt
    lse = shape.heads * t * 4
    layer_norms = int(not first) + int(shape.cross_attn_norm) + 1  # norm1 (input needs a gradient), norm2, norm3
    out = {"norms": layer_norms * s.norm(t, d) + 3 * s.norm(t, d, 1) + s.norm(c, d, 1),  # + q/k RMSNorms
           "modulation": s.b * d * 4 * (2 - int(first)) + s.b * 6 * d * 4,  # (1 + scale) copies, the 6-way table
           "attention": (6 * t * d + 2 * c * d) * dt + 2 * lse, "ffn": t * f * dt,
           "lora_inputs": 0, "lora_rank": 0}
    for name, n_in, n_out, text in shape.linears():
        rows = c if text else t
        out["lora_rank"] += rows * s.r * dt
        if s.amp:  # autocast's bf16 copy of B, and of A where A's input needs a gradient (A's weight is then saved)
            frozen_input = text or (first and name.startswith("attn1.") and name != "attn1.to_out.0")
            out["lora_rank"] += (n_out + (0 if frozen_input else n_in)) * s.r * dt
        if s.amp:  # every adapter its own bf16 cast of its input
            out["lora_inputs"] += rows * n_in * dt
        elif name in ("attn1.to_q", "attn2.to_q", "ffn.net.0.proj", "ffn.net.2"):
            # fp32: q/k/v share one input, to_out reads the attention output (counted there), the text states
            # are shared by every block (counted once outside)
            out["lora_inputs"] += rows * n_in * 4
    return out


def _saved(shape: WanShape, s: _Sizes, per_sample: int, ckpt: bool, add) -> None:
    d = shape.dim
    rope = 2 * per_sample * shape.head_dim * 4
    if ckpt:
        add("activations", shape.layers * s.t * d * s.dt, "saved",
            f"checkpointing: {shape.layers} block inputs x {s.t:,} tokens x {d} x {s.dt} B")
        add("block_context", s.c * d * s.dt + s.b * 6 * d * s.dt + rope, "saved",
            f"kept by the checkpoints: text states {s.c:,} x {d}, timestep projection, rotary tables")
    else:
        first, rest = block_saved(shape, s, True), block_saved(shape, s, False)
        parts = {k: first[k] + rest[k] * (shape.layers - 1) for k in rest}
        add("activations", sum(parts.values()), "saved",
            f"{shape.layers} blocks, {s.t:,} latent + {s.c:,} text tokens, {'bf16' if s.amp else 'fp32'}: "
            + ", ".join(f"{k} {v / MIB:.1f} MiB" for k, v in parts.items()))
        add("block_context", rope + (0 if s.amp else s.c * d * 4), "saved",
            "rotary tables" + ("" if s.amp else " + the fp32 text states the text adapters share"))
    out = s.t * math.prod(shape.patch) * shape.out_channels
    add("head_and_loss", s.norm(s.t, d) + s.b * d * 4 + out * 4, "saved",
        f"output LayerNorm fp32 input + the loss's fp32 prediction error ({out:,} x 4 B)")


def _transients(shape: WanShape, s: _Sizes, ckpt: bool, add) -> None:
    t, c, d, f, dt = s.t, s.c, shape.dim, shape.ffn, s.dt
    add("block_forward", t * (2 * f * dt + 2 * d * 4), "transient",
        f"a block's FFN output and LoRA sum ({t:,} x {f} x {dt} B x 2) + fp32 residual temporaries")
    # Allowance, not measured on a GPU yet: gradients of the residual stream (fp32 in the gated adds), of q/k/v/out
    # and the FFN intermediates, the text k/v gradients and an fp32 dq accumulator in flash attention's backward.
    grads = t * (2 * f * dt + 4 * d * dt + 3 * d * 4) + 2 * c * d * dt
    add("block_backward", grads, "backward", f"one block's activation gradients: {t:,} x (2 x {f} + 4 x {d}) x {dt} "
        f"B + fp32 residual/dq {t:,} x 3 x {d} x 4 B + text k/v {c:,} x 2 x {d} x {dt} B")
    if ckpt:
        rest = block_saved(shape, s, False)
        add("recompute", sum(rest.values()), "backward", "one block recomputed during backward (its saved tensors)")
    n = lora_param_count(shape, s.r)
    add("optimizer_step", 3 * n * 4, "step", "foreach AdamW temporaries, 3 x LoRA params x 4 B")


def describe(est: WanEstimate) -> dict:
    return {"model": est.shape.name, "shape": asdict(est.shape), "n_params": est.shape.n_params,
            "settings": est.settings, "tokens": est.tokens, "terms": est.by_name(),
            "saved_activation_bytes": est.saved_bytes, "total_bytes": est.total_bytes,
            "reserved_bytes": est.reserved_bytes, "terms_detail": [asdict(t) for t in est.terms]}


# --- rocktune plan --task video-lora|image-lora ----------------------------------------------------------------

MAX_FRAMES = 257  # the longest bucket searched: far past the 81 frames Wan was trained on


def largest_frames(shape: WanShape, spec: WanSpec, usable: int) -> int | None:
    """The largest frame bucket (temporal*k + 1) whose step of ``spec`` (its frames aside) fits ``usable`` bytes;
    None when one frame does not."""
    best = None
    for frames in range(1, MAX_FRAMES + 1, shape.vae_temporal):
        est = estimate_wan(shape, replace(spec, frames=frames))
        if est.reserved_bytes > usable:
            break
        best = frames
    return best


def run_wan_plan(model: str, task: str, spec: WanSpec, vram: str | None, as_json: bool) -> int:
    shape = load_wan_shape(model)
    if task == "image-lora":
        spec = replace(spec, frames=1)
    frames, checkpointing = spec.frames, spec.checkpointing
    if vram is not None:
        budget, source = parse_budget(vram), "given"
    else:
        budget, _, source = detect_budget()
    usable = int(budget * (1 - MARGIN))
    est, other = estimate_wan(shape, spec), estimate_wan(shape, replace(spec, checkpointing=not checkpointing))
    doc = describe(est) | {"task": task, "budget_bytes": budget, "budget_source": source,
                           "fits": est.reserved_bytes <= usable,
                           "other_checkpointing": {"checkpointing": not checkpointing, "terms": other.by_name(),
                                                   "total_bytes": other.total_bytes,
                                                   "reserved_bytes": other.reserved_bytes,
                                                   "fits": other.reserved_bytes <= usable}}
    if task == "video-lora":
        fit = {ckpt: largest_frames(shape, replace(spec, checkpointing=ckpt), usable) for ckpt in (False, True)}
        doc["largest_frames"] = {"without_checkpointing": fit[False], "with_checkpointing": fit[True]}
        doc["checkpointing_needed"] = (fit[False] or 0) < frames <= (fit[True] or 0)
    if as_json:
        print(json.dumps(doc, indent=1))
    else:
        _render(est, other, doc)
    return 0


def _render(est: WanEstimate, other: WanEstimate, doc: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    on, off = (est, other) if est.settings["gradient_checkpointing"] else (other, est)
    s = est.settings
    table = Table(title=f"{doc['model']}: {doc['n_params'] / 1e9:.2f}B params, {doc['task']} {s['width']}x"
                  f"{s['height']} x {s['frames']} frames, micro-batch {s['batch']} ({est.tokens:,} latent tokens, "
                  f"{s['text_tokens']} text tokens), LoRA r={s['lora_r']}, {s['precision']}", title_justify="left")
    for col in ("term", "no checkpointing", "checkpointing", "inputs"):
        table.add_column(col, justify="left" if col in ("term", "inputs") else "right",
                         overflow="fold" if col == "inputs" else "ellipsis")
    a, b = off.by_name(), on.by_name()
    details = {t.name: t.inputs for t in on.terms} | {t.name: t.inputs for t in off.terms}
    for name in dict.fromkeys([*a, *b]):
        table.add_row(name, fmt_bytes(a.get(name)), fmt_bytes(b.get(name)), details[name])
    table.add_section()
    table.add_row("peak allocated", fmt_bytes(off.total_bytes), fmt_bytes(on.total_bytes),
                  "static + saved + largest transient (compare with torch.cuda.max_memory_allocated)")
    table.add_row("[bold]reserved[/]", f"[bold]{fmt_bytes(off.reserved_bytes)}[/]",
                  f"[bold]{fmt_bytes(on.reserved_bytes)}[/]",
                  "peak + allocator overhead + device context")
    usable = doc["budget_bytes"] * (1 - MARGIN)
    table.add_row("fits?", yes_no(off.reserved_bytes <= usable), yes_no(on.reserved_bytes <= usable),
                  f"budget {fmt_bytes(doc['budget_bytes'])} ({doc['budget_source']}), {MARGIN:.0%} kept free")
    console = Console()
    console.print(table)
    if "largest_frames" in doc:
        most = doc["largest_frames"]
        console.print(f"largest frame bucket that fits at {s['width']}x{s['height']}: "
                      f"{most['without_checkpointing'] or 'none'} without checkpointing, "
                      f"{most['with_checkpointing'] or 'none'} with; {s['frames']} frames "
                      + ("need gradient_checkpointing: true" if doc["checkpointing_needed"] else
                         "fit without checkpointing" if (most["without_checkpointing"] or 0) >= s["frames"] else
                         "do not fit: lower the resolution, the frames or the rank"), highlight=False)
    console.print("Predictions for the transformer step; the VAE and the text encoder run before training and are "
                  "freed (their encode is not in this table).", highlight=False)
