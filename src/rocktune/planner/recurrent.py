"""Linear-attention layers (Gated DeltaNet: Qwen3.5, Qwen3.5-MoE, Qwen3-Next) from config.json, and what one saves
for backward in a LoRA step.

A Gated DeltaNet layer projects the hidden state to q/k/v (one ``in_proj_qkv``), the output gate z, and the per-head
beta and decay inputs (``in_proj_b``, ``in_proj_a``); q/k/v pass a depthwise causal conv1d (kernel
``linear_conv_kernel_dim``, SiLU), the chunked gated delta rule turns them into the output, a gated RMSNorm (per value
head, gated by SiLU(z)) and ``out_proj`` close it. Its recurrent state is heads x d_k x d_v per sequence; training
keeps the state at every chunk boundary, not per token.

Saved bytes are transformers' torch reference path as it runs on the CPU (``torch_chunk_gated_delta_rule``, chunks of
C = 64 positions, the sequence padded to P, a multiple of C), counted with ``saved_tensors_hooks`` in
``benchmarks/planner_validation.py`` (``--families``). Per layer, V value heads, B x S tokens:

- the conv: its input (the q/k/v projection) and its pre-activation output (S + kernel - 1 positions), in the
  activation dtype;
- the kernel works in fp32: q and k (repeated to the value heads; in an fp32 run with as many key as value heads,
  views of the conv's output, as Qwen3.5-0.8B and 2B have) before and their rsqrt after the L2 norm; five
  C x C tensors per chunk and head (the two products, the decay matrix, the masked UT system, the intra-chunk
  attention sliced per chunk); ten d_k-wide and three d_v-wide P-row tensors (the padded k/v, the chunked q and k
  and their transposes, the triangular solves, the per-chunk slices) — six d_k-wide where S is not a multiple of
  C, the padded copies then feeding the matmuls as views; the state before each chunk (under autocast two half
  copies of it, one for each matmul it meets); the decays and beta;
- the gated norm: its fp32 input, the gate and its SiLU, their product (four S x V x d_v) and the per-row rsqrt.
"""

from __future__ import annotations

from dataclasses import dataclass

from rocktune.errors import UserError

CHUNK = 64  # torch_chunk_gated_delta_rule's chunk_size (transformers calls it with the default)
# model types with Gated DeltaNet layers (linear_attention in layer_types)
GATED_DELTANET = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")


@dataclass(frozen=True)
class Mamba2:
    """Granite 4's Mamba2 mixer: ``heads`` of ``head_dim`` (inner = heads x head_dim = expand x hidden), B and C of
    ``groups`` x ``state`` each."""

    heads: int
    head_dim: int
    state: int
    groups: int
    chunk: int
    conv_bias: bool
    proj_bias: bool

    @property
    def inner(self) -> int:
        return self.heads * self.head_dim

    @property
    def conv_width(self) -> int:
        return self.inner + 2 * self.groups * self.state


@dataclass(frozen=True)
class LinearAttn:
    layers: int      # layers of this kind (the rest are full attention)
    k_heads: int
    v_heads: int
    k_dim: int       # per head
    v_dim: int
    kernel: int      # the causal conv1d's width
    first: bool      # the first layer is a linear-attention layer (its input needs no gradient)
    fused: bool = False  # Qwen3-Next: q/k/v/z in one in_proj_qkvz, beta's and the decay's inputs in in_proj_ba
    mamba: Mamba2 | None = None  # Granite 4: a Mamba2 mixer instead (its sizes; k/v fields unused)

    @property
    def key_width(self) -> int:
        return self.k_heads * self.k_dim

    @property
    def value_width(self) -> int:
        return self.v_heads * self.v_dim

    @property
    def conv_width(self) -> int:
        return 2 * self.key_width + self.value_width


def mamba_layers(config: dict, name: str) -> LinearAttn:
    """Granite 4's Mamba2 layers (``linear_attention`` in layer_types, or every layer where it is left out)."""
    layers, hidden = config["num_hidden_layers"], config["hidden_size"]
    kinds = (config.get("layer_types") or ["linear_attention"] * layers)[:layers]
    kinds = ["linear_attention" if k in ("mamba", "linear_attention") else k for k in kinds]
    heads, inner = config.get("mamba_n_heads") or 128, int((config.get("mamba_expand") or 2) * hidden)
    head_dim = config.get("mamba_d_head")
    head_dim = inner // heads if head_dim in (None, "auto") else head_dim
    if not isinstance(head_dim, int) or head_dim * heads != inner:
        raise UserError(f"{name}: mamba_n_heads x mamba_d_head must be mamba_expand x hidden_size ({inner}).")
    m = Mamba2(heads=heads, head_dim=head_dim, state=config.get("mamba_d_state") or 256,
               groups=config.get("mamba_n_groups") or 1, chunk=config.get("mamba_chunk_size") or 256,
               conv_bias=config.get("mamba_conv_bias", True) is not False,
               proj_bias=bool(config.get("mamba_proj_bias")))
    return LinearAttn(layers=sum(1 for k in kinds if k == "linear_attention"), k_heads=1, v_heads=heads, k_dim=1,
                      v_dim=head_dim, kernel=config.get("mamba_d_conv") or 4,
                      first=bool(kinds) and kinds[0] == "linear_attention", mamba=m)


def linear_attn(config: dict, name: str) -> LinearAttn:
    """The Gated DeltaNet fields of a text config, or a UserError naming what is missing."""
    if config.get("model_type") == "granitemoehybrid":
        return mamba_layers(config, name)
    layers = config["num_hidden_layers"]
    kinds = (config.get("layer_types") or _default_kinds(config, layers))[:layers]
    fields = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
              "linear_conv_kernel_dim")
    values = [config.get(k) for k in fields]
    if not all(isinstance(v, int) and v > 0 for v in values) or values[1] % values[0]:
        raise UserError(f"{name}: this {config.get('model_type')} config.json lacks a positive {', '.join(fields)} "
                        "(the value heads a multiple of the key heads); pass the model's own config.json.")
    nk, nv, dk, dv, kernel = values
    return LinearAttn(layers=sum(1 for k in kinds if k == "linear_attention"), k_heads=nk, v_heads=nv, k_dim=dk,
                      v_dim=dv, kernel=kernel, first=bool(kinds) and kinds[0] == "linear_attention",
                      fused=config.get("model_type") == "qwen3_next")


def _default_kinds(config: dict, layers: int) -> list[str]:
    """The config classes' default: full attention every ``full_attention_interval`` (4) layers."""
    step = config.get("full_attention_interval") or 4
    return ["linear_attention" if (i + 1) % step else "full_attention" for i in range(layers)]


def linears(la: LinearAttn, hidden: int) -> list[tuple[str, int, int, bool]]:
    """The layer's linear modules as (name, in, out, bias), as transformers names them."""
    if la.mamba is not None:  # in_proj makes the gate, x/B/C (the conv's input) and dt at once
        m = la.mamba
        return [("in_proj", hidden, m.inner + m.conv_width + m.heads, m.proj_bias),
                ("out_proj", m.inner, hidden, m.proj_bias)]
    if la.fused:
        return [("in_proj_qkvz", hidden, la.conv_width + la.value_width, False),
                ("in_proj_ba", hidden, 2 * la.v_heads, False), ("out_proj", la.value_width, hidden, False)]
    return [("in_proj_qkv", hidden, la.conv_width, False), ("in_proj_z", hidden, la.value_width, False),
            ("in_proj_b", hidden, la.v_heads, False), ("in_proj_a", hidden, la.v_heads, False),
            ("out_proj", la.value_width, hidden, False)]


def extra_params(la: LinearAttn) -> int:
    """Parameters besides the linears: the depthwise conv (no bias), dt_bias, A_log and the gated norm's weight
    (Mamba2: the conv's bias, D, a norm over the inner width)."""
    if la.mamba is not None:
        m = la.mamba
        return m.conv_width * (la.kernel + m.conv_bias) + 3 * m.heads + m.inner
    return la.conv_width * la.kernel + 2 * la.v_heads + la.v_dim


def saved(la: LinearAttn, tok) -> int:
    """Bytes one Gated DeltaNet mixer saves for backward (module docstring); ``tok``: activations.Tokens. The
    adapters' inputs and rank-r outputs are counted with every layer's (activations._lora)."""
    if la.mamba is not None:
        return mamba_saved(la, tok)
    b, s, dt = tok.batch, tok.seq, tok.dt
    chunks = -(-s // CHUNK)
    p, v, dk, dv = chunks * CHUNK, la.v_heads, la.k_dim, la.v_dim
    conv = b * s * la.conv_width * dt + b * la.conv_width * (s + la.kernel - 1) * dt
    state = chunks * b * v * dk * dv
    if tok.amp:  # the kernel's matmuls run in the half dtype under autocast: they save half copies of their inputs
        fp32 = 2 * b * v * p * CHUNK + b * v * p * (4 * dk + 2 * dv) + state
        # the state meets two matmuls a chunk (the queries', the keys' decays): cast to half for each
        half = 3 * b * v * p * CHUNK + b * v * p * (6 * dk + 2 * dv) + 2 * state
        norm = 4 * 3 * b * s * la.value_width + dt * b * s * la.value_width
    else:
        fp32 = 5 * b * v * p * CHUNK + b * v * p * ((10 if s % CHUNK == 0 else 6) * dk + 3 * dv) + state
        half = 0
        norm = 4 * 4 * b * s * la.value_width
    # q and k into the L2 norm (fp32 copies, repeated to the value heads), their rsqrt; with as many key heads as
    # value heads an fp32 run neither repeats nor casts them: they are views of the conv's output, q, k and v in one
    qk = b * s * la.conv_width if not tok.amp and la.k_heads == la.v_heads else 2 * b * v * s * dk
    fp32 += qk + 2 * b * v * s
    fp32 += 4 * b * v * p + b * v * chunks + v + b * s * v  # decays, beta; the chunk decays; exp(A_log); softplus in
    beta = b * s * v * dt                             # beta's sigmoid, in the projection's dtype
    return conv + 4 * fp32 + dt * half + 4 * (norm // 4 + b * s * v) + beta + CHUNK * CHUNK  # + the chunk's mask


def mamba_saved(la: LinearAttn, tok) -> int:
    """Bytes one Mamba2 mixer saves for backward on transformers' torch reference scan (``mamba2_chunk_scan``,
    chunks of L = ``mamba_chunk_size``, the sequence padded to c chunks), counted as ``saved``'s: the in_proj output
    (the conv's input is a view of it), the conv's pre-activation output and its SiLU; in fp32 the scan's chunked
    inputs (x three times, C and B five times between them at L x state per head), the L x L decay and masked
    products (three), the chunk states (c and c + 1 of them, head_dim x state per head), the decays, dt; the gated
    norm's product, the gate's SiLU and the grouped view, and its rsqrt.

    A sequence within one chunk (c = 1, as a released Granite 4's chunk of 256 holds a short row) lets the scan's
    einsums take some operands as views: the chunk states read back are the concatenated c + 1 (not a copy of c), in
    fp32 one x copy fewer, and with a single row two of the C and B copies too (measured on Granite-4.0-H-Tiny's
    widths, benchmarks/planner_validation.py --widths; exact on the standalone mixer at b = 1 and 2, c = 1 and 2)."""
    m, b, s, dt = la.mamba, tok.batch, tok.seq, tok.dt
    chunks = -(-s // m.chunk)
    p, h, one = chunks * m.chunk, m.heads, chunks == 1
    squares, states = b * chunks * h * m.chunk ** 2, (2 * chunks + 1 + one) * b * h * m.head_dim * m.state
    conv = b * s * (m.inner + m.conv_width + h) * dt + b * m.conv_width * (s + la.kernel - 1) * dt
    fixed = 2 * b * h * p + b * h * (chunks + 1) ** 2 + h + b * s * m.groups  # decays, the chunk decay, A, rsqrt
    if tok.amp:  # the scan's einsums run in the half dtype: half copies of their inputs, the fp32 originals fewer
        fp32 = b * s * m.inner + squares + b * p * h * m.state + b * s * h + 4 * b * s * m.inner + fixed
        half = 3 * b * p * m.inner + 2 * squares + 4 * b * p * h * m.state + states + b * h * (chunks + 1) ** 2 \
            + 2 * b * s * h
    else:  # the conv's SiLU output (x, B, C) is the scan's input itself
        conv += b * s * m.conv_width * dt
        fp32 = (3 - one) * b * p * m.inner + 3 * squares + (5 - 2 * (one and b == 1)) * b * p * h * m.state \
            + states + 3 * b * s * h + 3 * b * s * m.inner + fixed
        half = 0
    masks = 2 * m.chunk ** 2 + 2 * (chunks + 1) ** 2  # bool
    return conv + 4 * fp32 + dt * half + masks
