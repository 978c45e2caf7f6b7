"""Mixture-of-experts shapes from config.json, and what their experts cost in a LoRA step.

Each family names its MoE fields its own way (transformers 5 config classes): the experts are ``num_local_experts``
(Mixtral, gpt-oss, Llama 4; transformers 5's own saves of every family), ``num_experts`` (Qwen3-MoE, Qwen3.5-MoE,
Qwen3-Next hub files) or ``n_routed_experts`` (GLM-4.5); an expert's width is ``moe_intermediate_size`` where the
family has one, else ``intermediate_size``. Some layers keep a dense MLP (GLM's ``first_k_dense_replace``, Llama 4's
``moe_layers``, Qwen3-MoE's ``mlp_only_layers``/``decoder_sparse_step``), some MoE blocks add an always-on shared
expert (GLM, Llama 4, Qwen3.5, Qwen3-Next; the last two gate it with a 1-wide linear), gpt-oss biases every expert
and its router.

What one MoE layer saves for backward on rocktune's expert LoRA path (``lora/moe.py``; counted with
``saved_tensors_hooks`` in ``benchmarks/planner_validation.py``). Grouped (torch's grouped matmul: bf16 on a GPU):
R = top-k x tokens routed rows; the gathered input
of each row (read by the gate/up adapters' A), the gate/up output, the activation, the down projection's input
and output, the weighted output (``index_add_`` keeps its source), each adapter's rank-r product, the sort order and
row indices, and the router's softmax over all experts (fp32), its top-k indices and weights. No expert weight, no
adapted stack, no stack gradient. Padded (every other case, the CPU included): the per-expert tensors are
[experts, M] with M the busiest expert's rows, so they scale with the routing's imbalance (``RunSpec.expert_imbalance``,
the busiest expert's rows over the mean: an assumption, since the planner cannot see the routing), and the gathered
input, the output read back and the weighted rows are kept at R rows besides.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from rocktune.errors import UserError

EXPERT_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts")
# model.quantization nf4/fp4 stores the expert stacks in 4 bit (lora/moe_nf4.py: bitsandbytes' quantize_4bit per
# expert, blocks of 64 with an fp32 absmax each, no double quantisation) where the grouped expert path runs and
# all-linear adapts the experts; elsewhere (int8, other targets) bitsandbytes leaves the 3-D
# stacks as they are and PEFT's k-bit preparation casts them to fp32. tests/test_planner_moe.py checks both on a load.
EXPERTS_4BIT = True
FP32_ROUTERS = {"glm4_moe"}  # families whose router weight is created in fp32 whatever the model's dtype
# expert-width tensors a family's gating saves per routed row beyond SwiGLU's one activation: gpt-oss's clamped GLU
# (clamps, the scaled gate's sigmoid, the product)
GATE_EXTRA = {"gpt_oss": 3}
MXFP4_BYTES = 17 / 32  # an MXFP4 value on disk: 16 bytes of e2m1 pairs and one e8m0 exponent per 32 values


@dataclass(frozen=True)
class MoeShape:
    experts: int
    per_token: int
    width: int                 # one expert's intermediate width
    shared: int = 0            # the always-on shared expert's width (0: none)
    shared_gate: bool = False  # the shared expert's 1-wide sigmoid gate (Qwen3.5-MoE, Qwen3-Next)
    dense_layers: int = 0      # layers with a dense MLP instead of experts
    dense_width: int = 0
    expert_bias: bool = False  # gpt-oss: a bias on each expert's gate_up and down
    router_bias: bool = False  # gpt-oss
    mxfp4: bool = False        # the checkpoint ships the experts as MXFP4 (gpt-oss's release): dequantised at load


def moe_shape(config: dict, name: str) -> MoeShape:
    """The MoE fields of a text config (see the module docstring), or a UserError that names what is missing."""
    kind, layers = config.get("model_type"), config["num_hidden_layers"]
    experts = next((config[k] for k in EXPERT_FIELDS if config.get(k)), None)
    per_token = config.get("num_experts_per_tok")
    width = config.get("moe_intermediate_size") or config.get("intermediate_size")
    if not all(isinstance(v, int) and v > 0 for v in (experts, per_token, width)) or per_token > experts:
        raise UserError(f"{name}: this {kind} (mixture-of-experts) config.json lacks a positive "
                        f"{'/'.join(EXPERT_FIELDS)}, num_experts_per_tok (at most the experts) or the expert width "
                        "(moe_intermediate_size / intermediate_size); pass the model's own config.json.")
    dense, dense_width = _dense_layers(config, layers)
    shared = config.get("shared_expert_intermediate_size") or config.get("shared_intermediate_size") or 0
    if kind == "glm4_moe":
        shared = (config.get("n_shared_experts") or 0) * width
    elif kind == "llama4_text":
        shared = width  # Llama 4's shared expert is as wide as a routed one
    return MoeShape(experts, per_token, width, shared=shared, shared_gate=bool(shared) and kind in
                    ("qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next"), dense_layers=dense, dense_width=dense_width,
                    expert_bias=kind == "gpt_oss", router_bias=kind == "gpt_oss", mxfp4=mxfp4_checkpoint(config))


def mxfp4_checkpoint(config: dict) -> bool:
    """config.json says the experts are stored as MXFP4 (models/mxfp4.py)."""
    found = config.get("quantization_config")
    return isinstance(found, dict) and found.get("quant_method") == "mxfp4"


def mxfp4_note(shape, dt: int) -> str:
    """What ``base_weights`` says of an MXFP4 checkpoint's experts: they are counted dequantised, at ``dt`` bytes a
    value (models/mxfp4.py dequantises them at load, on every device), against their packed size on disk."""
    if not shape.mxfp4_experts:
        return ""
    values = shape.moe_layers * stack_values(shape)
    return (f", the expert stacks among them ({values:,} values) dequantised from MXFP4: {_size(values * dt)} against "
            f"{_size(values * MXFP4_BYTES)} packed in the checkpoint")


def refuse_quantised(shape, quant: str) -> None:
    """bitsandbytes on top of an MXFP4 checkpoint: transformers loads one quantisation method at a time (the load
    refuses it too, models/mxfp4.py)."""
    if shape.mxfp4_experts and quant != "none":
        raise UserError(f"{shape.name}: its experts are stored as MXFP4 (config.json quantization_config), which "
                        f"transformers cannot load with bitsandbytes' {quant} on top; plan it with --quant none "
                        "(the experts are dequantised for LoRA, counted here), or plan a bf16 copy of the "
                        "checkpoint.")


def mxfp4_fit_note(shape) -> str:
    """Why QLoRA does not rescue an MXFP4 checkpoint that fits nowhere, and what would."""
    values = shape.moe_layers * stack_values(shape)
    return (f"Its experts ship as MXFP4 and train dequantised ({_size(values * 2)} in bf16 against "
            f"{_size(values * MXFP4_BYTES)} packed); QLoRA (model.quantization: nf4) needs a bf16 copy of the "
            "checkpoint, whose expert stacks rocktune then stores in 4 bit.")


def _size(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


def _dense_layers(config: dict, layers: int) -> tuple[int, int]:
    """(layers with a dense MLP, its width), as the family's decoder layer decides it."""
    kind = config.get("model_type")
    if kind == "glm4_moe":
        first = config.get("first_k_dense_replace")
        return min(layers, 1 if first is None else first), config["intermediate_size"]
    if kind == "llama4_text":
        step = config.get("interleave_moe_layer_step") or 1
        moe = config.get("moe_layers")
        moe = list(range(step - 1, layers, step)) if moe is None else moe
        return layers - len(set(moe) & set(range(layers))), config.get("intermediate_size_mlp") or 0
    only, step = set(config.get("mlp_only_layers") or []), config.get("decoder_sparse_step") or 1
    dense = sum(1 for i in range(layers) if i in only or (i + 1) % step)
    return dense, config.get("intermediate_size") or 0


def mlp_params(shape) -> tuple[int, int]:
    """(parameters of one MoE block, of one dense MLP) of ``shape`` (a ModelShape)."""
    h, w, e = shape.hidden, shape.expert_intermediate, shape.experts
    block = e * 3 * h * w + e * h  # the expert stacks (gate, up, down) and the router
    block += e * (2 * w + h) if shape.expert_bias else 0
    block += e if shape.router_bias else 0
    block += 3 * h * shape.shared_intermediate + (h if shape.shared_gate else 0)
    return block, 3 * h * shape.dense_intermediate


def shared_linears(shape) -> list[tuple[str, int, int, bool]]:
    """The shared expert's linear modules (what all-linear adapts in an MoE block besides the expert stacks)."""
    h, s = shape.hidden, shape.shared_intermediate
    if shape.model_type == "granitemoehybrid":  # Granite's shared MLP: gate and up fused in input_linear
        return [("input_linear", h, 2 * s, False), ("output_linear", s, h, False)] if s else []
    return [("gate_proj", h, s, False), ("up_proj", h, s, False), ("down_proj", s, h, False)] if s else []


def stack_values(shape) -> int:
    """Values of one layer's expert stacks (gate, up and down of every expert)."""
    return shape.experts * 3 * shape.hidden * shape.expert_intermediate


def quantised_values(shape) -> int:
    """Linear weight values a quantised MoE base stores beyond ``linears`` x layers: the dense layers' MLP in place
    of the shared expert ``linears`` counted for them."""
    shared = sum(i * o for _, i, o, _ in shared_linears(shape))
    return shape.dense_layers * (3 * shape.hidden * shape.dense_intermediate - shared)


def stacks_4bit(shape, quant: str, all_linear: bool) -> bool:
    """Whether a quantised run stores this model's expert stacks in 4 bit (``EXPERTS_4BIT``)."""
    return EXPERTS_4BIT and bool(shape.experts) and quant in ("nf4", "fp4") and all_linear


def stack_bytes_4bit(shape, quantised_bytes) -> int:
    """lora/moe_nf4.py's storage of every layer's stacks: each expert's gate_up and down packed two values a byte,
    an fp32 absmax per 64 values (``quantised_bytes``: estimate's, passed in to keep this module below it)."""
    h, w = shape.hidden, shape.expert_intermediate
    per_expert = quantised_bytes(2 * w * h, 1, "nf4", False) + quantised_bytes(w * h, 1, "nf4", False)
    return shape.moe_layers * shape.experts * per_expert


def saved(shape, tok) -> int:
    """Bytes one MoE block saves for backward (module docstring); ``tok``: activations.Tokens."""
    t, dt, h, w, r = tok.t, tok.dt, shape.hidden, shape.expert_intermediate, tok.rank
    rows = t * shape.experts_per_token
    # the routed rows are cast to the compute dtype (lora/moe.py), even off a QLoRA base's fp32 stream; the shared
    # expert's Linear4bit layers return the stream's dtype
    width, stream = dt, tok.stream or dt
    mid = (4 + GATE_EXTRA.get(shape.model_type, 0)) * w  # gate/up out, activation(s), down input
    shared = 3 * t * shape.shared_intermediate * stream if shape.shared_intermediate else 0
    # the fp32 factors cast to the compute dtype, per stack
    casts = shape.experts * r * ((h + 2 * w) + (w + h)) * dt if tok.amp else 0
    if tok.expert_pad:  # padded path: the [experts, busiest] tensors, and the gather, output and weighted rows
        padded = shape.experts * math.ceil(rows / shape.experts * tok.expert_pad)
        routed = padded * (h + mid) * width + rows * 3 * h * width
        ranks = padded * 2 * r * dt + rows * (3 * 8 + 4)  # rank-r products; the sort, slots, rows, weights
    else:  # grouped: the gathered input, gate/up out, activation, down input and output, the weighted rows
        routed = rows * (3 * h + mid) * width
        ranks = rows * 2 * r * dt + rows * (2 * 8 + 4)  # the two adapters' rank-r products; the sort, rows, weights
    ranks += casts
    # softmax over the experts (fp32), the top-k indices and weights, and the weights' sum (norm_topk_prob)
    router = t * shape.experts * 4 + t * shape.experts_per_token * (8 + 4) + t * 4
    return routed + ranks + router + shared


def fp32_router_values(shape) -> int:
    """Router weights kept in fp32 in a half-precision model (GLM-4.5's)."""
    return shape.moe_layers * shape.experts * shape.hidden if shape.model_type in FP32_ROUTERS else 0


def dense_delta(shape, tok) -> int:
    """What the layers with a dense MLP save beyond an MoE layer's count (negative: less): their MLP (gate out,
    activation, up out) in place of the MoE block, and the down adapter's input at the dense width."""
    if not shape.dense_layers:
        return 0
    width = tok.stream or tok.dt
    dense = 3 * tok.t * shape.dense_intermediate * width
    down_in = tok.t * (shape.dense_intermediate - shape.shared_intermediate) * (tok.dt if tok.amp else 4)
    return shape.dense_layers * (dense + down_in - saved(shape, tok))
