"""Memory of one LoRA training step, term by term, each with the inputs it was derived from.

Phases: *static* bytes live the whole run (weights, adapters, their gradients and AdamW states); *saved* bytes
are held from the forward pass into backward (see ``activations``); *transient* bytes exist in one phase only
(the loss chunk, one layer's gradients, a recomputed layer). The predicted allocated peak is
static + saved + the largest transient; allocator overhead and the device context come on top of it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from rocktune.planner import gemma4, moe
from rocktune.planner.activations import GROUP, Tokens, layer_saved, lora_modules
from rocktune.planner.shapes import ModelShape

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
QUANT = ("int8", "nf4", "fp4")
ATTN = ("sdpa", "eager", "flash_attention_2", "varlen")
MIB = 2**20
GIB = 2**30
# Not visible to torch's allocator counters: CUDA/HIP context, kernels and BLAS workspaces (GPU), or the Python +
# torch + transformers resident set (CPU). Allowances, shown as such.
CONTEXT = {"gpu": 512 * MIB, "cpu": 1 * GIB}
# The caching allocator rounds blocks and fragments over a long run (seed 003 died of it after 35-50 batches).
FRAGMENTATION = 0.10


@dataclass(frozen=True)
class RunSpec:
    micro_batch: int = 1
    seq_len: int = 1024
    lora_r: int = 8
    targets: tuple[str, ...] | str = "all-linear"
    precision: str = "fp32"  # fp32 | bf16 | fp16 (activations and, unless quantised, base weights)
    quant: str = "none"  # none | int8 | nf4 | fp4 (QLoRA base weights)
    double_quant: bool = True  # nf4/fp4: the per-block scales quantised too
    attn: str = "sdpa"  # sdpa | eager | flash_attention_2 | varlen (rocktune's GPU path: planner/varlen.py)
    checkpointing: bool = False
    lora_dropout: float = 0.0
    loss_mode: str = "chunked"  # chunked: loss positions only, chunk by chunk; full: HF labels= with full logits
    loss_chunk: int = 256
    loss_fraction: float = 1.0  # share of positions whose next token carries loss
    padded: bool | None = None  # a padding mask is present; None: whenever micro_batch > 1
    device: str = "gpu"  # gpu | cpu (dropout mask dtype, context allowance)
    ranks: int = 1  # processes training together (--nproc x nodes); the estimate is per rank
    parallel: str = "ddp"  # ddp: base replicated | fsdp: decoder layers' base weights sharded over the ranks
    compiled: bool = False  # the decoder and the loss chunk run under torch.compile (activations: varlen only)
    kv_copies: bool = False  # varlen: the kernel takes no grouped-query K/V (torch 2.11): K/V repeated per head
    rollout_rows: int = 0  # task grpo: completions sampled together (one batch, a KV cache row each)
    rollout_prompt: int = 0  # task grpo: prompt tokens per row (the prefill)
    rollout_new: int = 0  # task grpo: the most tokens a completion adds to its row's KV cache
    # MoE off the grouped kernel (fp32, the CPU): the busiest expert's routed rows over the mean (planner/moe.py)
    expert_imbalance: float = 1.5

    def __post_init__(self):
        # Accept the config's forms: a list of module names, one name, "auto" attention (SDPA where it runs).
        t = self.targets
        if not isinstance(t, str) or t not in ("all-linear", "all"):
            object.__setattr__(self, "targets", (t,) if isinstance(t, str) else tuple(t))
        if self.attn == "auto":
            object.__setattr__(self, "attn", "sdpa")


@dataclass
class Term:
    name: str
    bytes: int
    phase: str  # static | saved | transient (forward) | backward | step | overhead
    inputs: str


class TermSums:
    """Sums over ``self.terms`` by phase: what the LM and Wan estimates share."""

    terms: list[Term]

    def by_name(self) -> dict[str, int]:
        return {t.name: t.bytes for t in self.terms}

    def phase(self, phase: str) -> int:
        return sum(t.bytes for t in self.terms if t.phase == phase)

    @property
    def saved_bytes(self) -> int:
        return self.phase("saved")

    @property
    def peak_transient_bytes(self) -> int:
        """Only one of these phases happens at a time; the backward terms (recompute + gradients) coexist."""
        return max(self.phase("transient"), self.phase("backward"), self.phase("step"))


@dataclass
class Estimate(TermSums):
    shape: ModelShape
    spec: RunSpec
    terms: list[Term] = field(default_factory=list)

    @property
    def peak_allocated(self) -> int:
        """The update's peak, or the rollout's (GRPO), or the frozen vision tower's forward (task=vlm), whichever is
        larger: the KV cache is freed before the update's forward starts, and the vision tower runs (saving nothing)
        before the language model does. The batch (task=vlm: the pixels) lives through all of them."""
        return self.phase("static") + self.phase("batch") + max(self.saved_bytes + self.peak_transient_bytes,
                                                                self.phase("rollout"), self.phase("vision"))

    @property
    def total_bytes(self) -> int:
        return self.peak_allocated + self.phase("overhead")

    def settings(self) -> dict:
        return asdict(self.spec)


def lora_param_count(shape: ModelShape, spec: RunSpec) -> int:
    linear = sum(n * spec.lora_r * (n_in + n_out) for n, lin in shape.layer_linears()
                 for _, n_in, n_out in lora_modules(shape, spec.targets, lin))
    linear += sum(spec.lora_r * (n_in + n_out) for _, n_in, n_out in model_lora_modules(shape, spec.targets))
    return linear + expert_lora_count(shape, spec)


def model_lora_modules(shape: ModelShape, targets) -> list[tuple[str, int, int]]:
    """Adapted linears outside the layers (Gemma 4's per_layer_model_projection), by all-linear or by name."""
    every = targets in ("all-linear", "all", None)
    return [(n, i, o) for n, i, o, _ in shape.model_linears() if every or n in set(targets)]


def expert_lora_count(shape: ModelShape, spec: RunSpec) -> int:
    """all-linear on an MoE model also adapts every expert (model.lora_targets): PEFT's parameter LoRA gives each
    3-D weight an (r x experts, in) A and an (out, r x experts) B, for gate_up (h -> 2 x width) and down. The layers
    that keep a dense MLP adapt it instead of a shared expert (``linears`` lists the MoE layer's)."""
    if not shape.experts or spec.targets not in ("all-linear", "all", None):
        return 0
    h, w, d = shape.hidden, shape.expert_intermediate, shape.dense_intermediate
    shared = sum(i + o for _, i, o, _ in moe.shared_linears(shape))
    dense = shape.dense_layers * spec.lora_r * ((3 * h + 3 * d if d else 0) - shared)
    return shape.moe_layers * spec.lora_r * shape.experts * ((h + 2 * w) + (w + h)) + dense


def estimate(shape: ModelShape, spec: RunSpec) -> Estimate:
    moe.refuse_quantised(shape, spec.quant)
    est = Estimate(shape, spec)
    def add(name, n, phase, inputs):
        return est.terms.append(Term(name, int(n), phase, inputs))
    _static(shape, spec, add)
    tok = _tokens(spec, shape)
    n_loss = max(1, round(spec.loss_fraction * spec.micro_batch * (spec.seq_len - 1)))
    dims = f"b={spec.micro_batch} s={spec.seq_len} ({tok.t} tokens), {spec.precision} activations"
    first = layer_saved(shape, tok, spec.targets, input_grad=spec.checkpointing)
    rest = layer_saved(shape, tok, spec.targets, input_grad=True)
    linear = _linear_layers(shape, spec, tok)
    if shape.gemma4 is not None:  # layers of two widths: each kind sized as its own (planner/gemma4.py)
        first, rest, per_kind = _gemma4_layers(shape, spec, tok)
    sliding = _sliding_layer(shape, spec, tok)
    if spec.checkpointing:
        width = tok.stream or tok.dt
        add("activations", shape.layers * tok.t * shape.hidden * width, "saved",
            f"checkpointing: {shape.layers} layer inputs x {tok.t} x {shape.hidden} x {width} B")
        again = max(rest, sliding or rest, linear[1] if linear else rest, key=lambda d: sum(d.values()))
        add("recompute", sum(again.values()), "backward",
            f"one layer recomputed during backward: {_parts(again)}")
        if _padded(spec) or spec.attn == "eager":  # eager always builds a float causal mask; sdpa only to pad
            add("attention_mask", spec.micro_batch * spec.seq_len ** 2 * (tok.dt if spec.attn == "eager" else 1),
                "saved", "4-D attention mask, kept by the checkpoints for recomputation")
        if sliding is not None:
            add("sliding_mask", spec.micro_batch * spec.seq_len ** 2 * (tok.dt if spec.attn == "eager" else 1),
                "saved", f"the sliding-window layers' own 4-D mask (window {shape.sliding_window}), kept by their "
                "checkpoints")
    else:
        per = {k: first[k] + rest[k] * (shape.layers - 1) for k in rest} if shape.gemma4 is None else per_kind
        if linear:  # a hybrid: its linear-attention layers (the first among them) in place of full ones
            la, (lin_first, lin_rest) = shape.linear_attn, linear
            first_swap = {k: lin_first[k] - first[k] + rest[k] - lin_rest[k] for k in rest} if la.first else {}
            per = {k: per[k] + la.layers * (lin_rest[k] - rest[k]) + first_swap.get(k, 0) for k in rest}
        for k, v in (sliding or {}).items():  # the windowed layers attend with a mask, as a padded batch does
            per[k] += shape.sliding_layers * (v - rest[k])
        per["mlp"] += moe.dense_delta(shape, tok)  # an MoE model's dense-MLP layers (GLM's first, Llama 4's)
        drop = per.pop("lora_dropout")
        scores = per.pop("attention_scores") + per.pop("attention_mask")
        add("activations", sum(per.values()), "saved", f"{shape.layers} layers, {dims}, {spec.attn}: {_parts(per)}")
        if scores:
            add("attention_scores", scores, "saved", f"{spec.attn}: s x s per head and layer (scores, float mask)")
        if drop:
            add("lora_dropout", drop, "saved", f"p={spec.lora_dropout}: mask + dropped copy per adapter input")
    _outside_layers(shape, spec, tok, n_loss, add)
    _transients(shape, spec, tok, n_loss, rest, add)
    if spec.rollout_rows:
        _rollout(shape, spec, tok.dt, add)
    dynamic = max(est.saved_bytes + est.peak_transient_bytes, est.phase("rollout"))
    add("allocator_overhead", FRAGMENTATION * dynamic + 64 * MIB, "overhead",
        f"{FRAGMENTATION:.0%} of activations + transients + 64 MiB for block rounding and fragmentation")
    add("device_context", CONTEXT[spec.device], "overhead",
        "CUDA/HIP context + BLAS workspaces" if spec.device == "gpu" else "Python + torch resident set")
    return est


def _gemma4_layers(shape: ModelShape, spec: RunSpec, tok: Tokens) -> tuple[dict, dict, dict]:
    """Gemma 4: (the first layer, the largest other layer, the sum over every layer), each kind of layer sized with
    its own head width, key/value heads and MLP, its sliding window's mask where it binds, and its per-layer input."""
    total: dict[str, int] = {}
    first = rest = None
    for i, kind in enumerate(shape.gemma4.kinds):
        variant = replace(shape, head_dim=kind.head_dim, kv_heads=kind.kv_heads, intermediate=kind.mlp, gemma4=None)
        masked = kind.sliding and spec.seq_len > shape.sliding_window and spec.attn in ("sdpa", "eager")
        ktok = replace(tok, padded=True) if masked else tok
        one = layer_saved(variant, ktok, _gemma4_targets(shape, kind, spec.targets), input_grad=True)
        one["attention"] += gemma4.saved_extra(shape, kind, tok)
        if i == 0:
            first = layer_saved(variant, ktok, _gemma4_targets(shape, kind, spec.targets),
                                input_grad=spec.checkpointing)
            first["attention"] += gemma4.saved_extra(shape, kind, tok)
        for k, v in one.items():
            total[k] = total.get(k, 0) + v * kind.layers - (v - first[k] if i == 0 else 0)
        rest = one if rest is None or sum(one.values()) > sum(rest.values()) else rest
    return first, rest, total


def _gemma4_targets(shape: ModelShape, kind, targets):
    """A Gemma 4 layer's adapted projections that the standard layer model sizes (the per-layer input's are
    gemma4.saved_extra's)."""
    if targets not in ("all-linear", "all", None):
        return [t for t in targets if t in GROUP]
    names = [n for n, *_ in gemma4.linears(kind, shape.hidden, shape.heads, 0)]
    return names


def _linear_layers(shape: ModelShape, spec: RunSpec, tok: Tokens) -> tuple[dict, dict] | None:
    """A hybrid's linear-attention layer as (the first layer, any other), or None for a model without them."""
    if shape.linear_attn is None or not shape.linear_attn.layers:
        return None
    return (layer_saved(shape, tok, spec.targets, input_grad=spec.checkpointing, linear=True),
            layer_saved(shape, tok, spec.targets, input_grad=True, linear=True))


def _sliding_layer(shape: ModelShape, spec: RunSpec, tok: Tokens) -> dict[str, int] | None:
    """What one sliding-window layer saves, where its window is shorter than the sequence (OLMo 3): transformers
    then builds it a mask of its own, and SDPA takes it as it takes a padding mask (a float copy saved, grouped K/V
    repeated). None where no layer has a window that binds (varlen: the kernel's window, no mask)."""
    if not shape.sliding_layers or spec.seq_len <= shape.sliding_window or spec.attn not in ("sdpa", "eager"):
        return None
    if shape.gemma4 is not None:  # sized per kind of layer (_gemma4_layers); the checkpoints keep the mask
        return {}
    return layer_saved(shape, replace(tok, padded=True), spec.targets, input_grad=True)


def _rollout(shape: ModelShape, spec: RunSpec, dt: int, add) -> None:
    """GRPO's sampling (tasks/grpo/rollout.py): every completion of a step in one batch, a KV cache that grows to
    prompt + completion tokens per row, and each token's last-position logits (float, with their softmax)."""
    rows, prompt = spec.rollout_rows, spec.rollout_prompt
    tokens = prompt + spec.rollout_new
    la = shape.linear_attn
    layers = shape.layers - (la.layers if la else 0)  # a hybrid's linear-attention layers keep a state, not K/V
    kv = layers * shape.kv_dim
    if shape.gemma4 is not None:  # each kind at its own width; KV-shared layers read another layer's
        kv = sum(k.layers * k.kv_heads * k.head_dim for k in shape.gemma4.kinds if k.own_kv)
    add("rollout_kv_cache", 2 * kv * dt * rows * tokens, "rollout",
        f"K and V of {layers} attention layers ({kv:,} values a token) x {dt} B, {rows} rows x {tokens} tokens")
    if la is not None and la.layers:  # the last kernel-width inputs of the conv, and the fp32 recurrent state
        conv, state = la.conv_width * la.kernel * dt, la.v_heads * la.k_dim * la.v_dim * 4
        add("rollout_recurrent_state", la.layers * rows * (conv + state), "rollout",
            f"{la.layers} linear-attention layers x {rows} rows: the conv cache ({la.conv_width} x {la.kernel} x "
            f"{dt} B) and the state ({la.v_heads} x {la.k_dim} x {la.v_dim} x 4 B), whatever the length")
    add("rollout_logits", 2 * rows * shape.vocab * 4, "rollout",
        f"the last position's logits and probabilities, {rows} rows x {shape.vocab} x fp32")
    add("rollout_prefill", rows * prompt * (2 * shape.hidden + 2 * shape.intermediate) * dt, "rollout",
        f"the prefill of {rows} x {prompt} prompt tokens: one layer's hidden and MLP activations at a time, no "
        "gradients")


def _padded(spec: RunSpec) -> bool:
    if spec.attn == "varlen":  # document bounds, never a mask
        return False
    return spec.micro_batch > 1 if spec.padded is None else spec.padded


def _tokens(spec: RunSpec, shape: ModelShape) -> Tokens:
    dt = DTYPE_BYTES[spec.precision]
    # PEFT's k-bit preparation keeps embeddings and norms in fp32, and a 4/8-bit linear returns its input's dtype:
    # a quantised run's residual stream and linear outputs stay fp32 under half autocast; only what autocast
    # casts (attention, the adapters' inputs) is half (saved bytes measured on CPU: benchmarks/planner_validation.py)
    return Tokens(batch=spec.micro_batch, seq=spec.seq_len, dt=dt, amp=dt != 4, attn=spec.attn,
                  stream=4 if spec.quant != "none" else 0,
                  padded=_padded(spec), rank=spec.lora_r, dropout=spec.lora_dropout,
                  mask_bytes=1 if spec.device == "gpu" else 4, compiled=spec.compiled and spec.attn == "varlen",
                  kv_copies=spec.kv_copies, expert_pad=0.0 if grouped_experts(spec, shape) else spec.expert_imbalance)


def grouped_experts(spec: RunSpec, shape: ModelShape) -> bool:
    """lora/moe.py's expert path: torch's grouped matmul in bf16 on a GPU, its rows 16-byte aligned (the rank and the
    stacks' widths multiples of 8); a padded batched matmul otherwise."""
    widths = (spec.lora_r, shape.hidden, shape.expert_intermediate)
    return spec.device == "gpu" and spec.precision == "bf16" and all(w % 8 == 0 for w in widths)


def _parts(parts: dict[str, int]) -> str:
    return ", ".join(f"{k} {v / MIB:.1f} MiB" for k, v in parts.items() if v)


def _static(shape: ModelShape, spec: RunSpec, add) -> None:
    dt = DTYPE_BYTES[spec.precision]
    if spec.quant == "none" and spec.ranks > 1 and spec.parallel == "fsdp":
        _fsdp_weights(shape, spec, dt, add)
    elif spec.quant == "none":
        fp32 = moe.fp32_router_values(shape)
        add("base_weights", shape.n_params * dt + fp32 * (4 - dt), "static",
            f"{shape.n_params:,} params x {dt} B ({spec.precision})" + (f", {fp32:,} router weights fp32" if fp32
                                                                         else "") + moe.mxfp4_note(shape, dt))
    else:
        linear = sum(n * i * o for n, lin in shape.layer_linears() for _, i, o, _ in lin)
        quantised = sum(n * quantised_bytes(i, o, spec.quant, spec.double_quant) for n, lin in shape.layer_linears()
                        for _, i, o, _ in lin)
        extra = moe.quantised_values(shape) if shape.experts else 0  # dense layers' MLPs are Linears too
        linear += extra
        quantised += quantised_bytes(extra, 1, spec.quant, spec.double_quant) if extra else 0
        four_bit = moe.stacks_4bit(shape, spec.quant, spec.targets in ("all-linear", "all", None))
        if four_bit:  # lora/moe_nf4.py
            linear += shape.moe_layers * moe.stack_values(shape)
            quantised += moe.stack_bytes_4bit(shape, quantised_bytes)
        rest = shape.n_params - linear
        stacks = "" if four_bit or not shape.experts else \
            f", the expert stacks among them ({shape.moe_layers * moe.stack_values(shape):,}: not quantised here)"
        # PEFT's k-bit preparation casts every weight it did not quantise (embeddings, head, norms, biases) to fp32
        add("base_weights", quantised + rest * 4, "static",
            f"{linear:,} linear{' and expert' if four_bit else ''} params as {spec.quant} "
            f"({quantised / linear:.3f} B each with scales) + {rest:,} others x 4 B (fp32 after k-bit preparation"
            f"{stacks})")
    n = lora_param_count(shape, spec)
    mods = list(dict.fromkeys(m for _, lin in shape.layer_linears() for m, _, _ in lora_modules(shape, spec.targets,
                                                                                                 lin)))
    mods += ["every expert's gate_up and down"] if expert_lora_count(shape, spec) else []
    add("lora_params", n * 4, "static", f"{n:,} params (r={spec.lora_r} on {', '.join(mods)}) x 4 B fp32")
    add("lora_grads", n * 4, "static", f"{n:,} fp32 gradients (the frozen base gets none)")
    add("adamw_states", n * 8, "static", f"{n:,} x 2 fp32 states (exp_avg, exp_avg_sq), LoRA params only")
    if spec.ranks > 1:  # DDP's reducer copies gradients into its buckets; FSDP mode all-reduces one flat copy
        add("gradient_buckets", n * 4, "static", f"{n:,} fp32 adapter gradients in the all-reduce buffers")


def _fsdp_weights(shape: ModelShape, spec: RunSpec, dt: int, add) -> None:
    """FSDP2: each rank keeps 1/ranks of the decoder layers' weights; a layer is gathered whole for its forward and
    backward, and the next one is prefetched, so two layers' weights exist at once. Embeddings, final norm and head
    are replicated (the fused loss reads the head's weight directly)."""
    counts = shape.param_counts()
    layers = counts["layers"]
    rest = shape.n_params - layers
    add("base_weights", layers * dt / spec.ranks + rest * dt, "static",
        f"{layers:,} layer params / {spec.ranks} ranks + {rest:,} replicated (embeddings, norm, head) x {dt} B")
    add("fsdp_gathered_layers", 2 * layers // shape.layers * dt, "transient",
        f"two decoder layers gathered whole (the one computing and the prefetched next): 2 x "
        f"{layers // shape.layers:,} params x {dt} B")


def quantised_bytes(n_in: int, n_out: int, quant: str, double_quant: bool = True) -> int:
    """Bytes of one bitsandbytes-quantised weight: int8 keeps an fp32 scale per output row; nf4/fp4 pack two
    values a byte with an absmax per 64-value block (fp32, or 8-bit plus an fp32 per 256 blocks when doubled)."""
    n = n_in * n_out
    if quant == "int8":
        return n + 4 * n_out
    blocks = -(-n // 64)
    return -(-n // 2) + (blocks + 4 * -(-blocks // 256) if double_quant else 4 * blocks)


def _outside_layers(shape: ModelShape, spec: RunSpec, tok: Tokens, n_loss: int, add) -> None:
    h, dt, s = shape.hidden, tok.dt, spec.seq_len
    norm = tok.t * (4 * h + 4) + (4 * h if shape.norms_per_layer == 4 else 0)  # Gemma's sandwich norms
    if tok.compiled:  # compiled, a norm keeps its input in the stream's dtype and the rsqrt (planner/varlen.py)
        norm = tok.t * ((tok.stream or dt) * h + 4)
    # cos/sin per position id: one row of positions for padded batches, one per packed row (positions restart)
    # cos/sin are computed in the embeddings' dtype: fp32 on a QLoRA base (k-bit preparation)
    rope = 2 * (spec.micro_batch if spec.attn == "varlen" else 1) * s * int(shape.head_dim * shape.rotary_fraction) \
        * (4 if shape.rope_fp32 else tok.stream or dt)
    rope *= shape.rope_tables  # OLMo 3: the sliding and the full layers' tables
    if shape.gemma4 is not None:  # a table per kind of layer, each its own width; the per-layer inputs
        rope = gemma4.rope_values(shape, s) * (tok.stream or dt) + gemma4.saved_outside(shape, tok,
                                                                                     spec.checkpointing)
    if shape.model_type == "llama4_text":  # one complex64 rotation per pair of dimensions, in any precision
        rope = rope // (2 * (tok.stream or dt)) * 4
    add("final_norm_rope", norm + rope, "saved", f"final RMSNorm input {tok.t} x {h} + cos/sin")
    if _loss_mode(shape, spec) == "chunked":
        # The fused loss keeps d(loss)/d(hidden) in the hidden dtype, except fp16 (fp32: it would underflow there);
        # the hidden states of a QLoRA base are fp32 (see _tokens).
        g = 4 if spec.precision == "fp16" or tok.stream else dt
        add("loss_saved", n_loss * (h * g + 16), "saved",
            f"{n_loss} loss positions: hidden-state gradient x {h} x {g} B + gather indices")
    else:
        n_full = spec.micro_batch * (s - 1)
        # Gemma 4's soft-cap keeps its tanh, in the activation dtype (measured; Gemma 2/3 are not validated here)
        cap = tok.t * shape.vocab * dt if shape.final_softcap and shape.gemma4 is not None else 0
        add("loss_saved", n_full * shape.vocab * 4 + n_full * 8 + cap, "saved",
            f"full logits: log-softmax {n_full} x {shape.vocab} x 4 B" + (", the soft-cap's tanh" if cap else ""))


def _loss_mode(shape: ModelShape, spec: RunSpec) -> str:
    # A final-logit soft-cap or a logit scale (Granite's) is not reproduced by the chunked loss: such models take
    # the full-logits path (tasks/causal/loss.py).
    return "full" if shape.final_softcap or shape.head_transform else spec.loss_mode


def _transients(shape: ModelShape, spec: RunSpec, tok: Tokens, n_loss: int, layer: dict, add) -> None:
    v, h, dt, i = shape.vocab, shape.hidden, tok.dt, shape.mlp_width
    if _loss_mode(shape, spec) == "chunked":
        rows = min(spec.loss_chunk, n_loss)
        # Eagerly the fp32 logits and logsumexp's full-size temporary (logits - max) coexist (8 B an entry; the half
        # copy for the gradient matmul comes after, 4 + 2). Compiled (the chunk body compiles with the decoder) one
        # fused kernel leaves the logits and the gradient in the matmul dtype (fp32: the gradient over the logits).
        per = (2 * dt if tok.amp else 4) if spec.compiled else 8
        what = "fused, compiled" if spec.compiled else "fp32 logits + logsumexp's temporary"
        add("loss_chunk", rows * v * per + n_loss * h * (tok.stream or dt), "transient",
            f"{rows} rows x {v} vocab x {per} B ({what}) + gathered hidden states")
    else:
        n_full = spec.micro_batch * (spec.seq_len - 1)
        add("full_logits", tok.t * v * dt + 2 * n_full * v * 4, "transient",
            f"logits {tok.t} x {v} x {dt} B + fp32 copy and its gradient")
    # One layer's backward: gradients of the residual stream, the MLP intermediates and (eager) the scores.
    grads = tok.t * (3 * h + 3 * i) * dt + (layer["attention_scores"] if spec.attn == "eager" else 0)
    add("layer_backward", grads, "backward", f"one layer's activation gradients: {tok.t} x (3 x {h} + 3 x {i}) x "
        f"{dt} B" + (" + s x s score gradients" if spec.attn == "eager" else ""))
    if spec.quant != "none":  # bitsandbytes dequantises a whole weight for each matmul, backward included
        big = max(n_in * n_out for _, lin in shape.layer_linears() for _, n_in, n_out, _ in lin)
        cdt = DTYPE_BYTES[spec.precision] if spec.quant != "int8" else 2  # int8 works on fp16 copies
        add("dequantised_weight", big * cdt, "backward", f"largest linear ({big:,} values) dequantised, {cdt} B each")
    n = lora_param_count(shape, spec)
    if spec.device == "gpu":  # training.optimizer auto: fused AdamW on a GPU updates in place, tensor by tensor
        add("optimizer_step", 0, "step", "fused AdamW (the GPU default): no temporaries")
    else:
        add("optimizer_step", 3 * n * 4, "step", "foreach AdamW temporaries (the CPU default), 3 x LoRA params x 4 B")
