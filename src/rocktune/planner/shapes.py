"""Model shape from a Hugging Face ``config.json`` (a file, a model directory, or a built-in preset) — no weights.

Only the fields that size tensors are read. Architectures differ in a few traits (fused projections, q/k norms,
extra norms, biases); those live in ``ARCH_TRAITS`` as data, so supporting a new decoder family is one entry.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from rocktune.errors import UserError
from rocktune.planner import gemma4, moe, recurrent

# Per model_type: how the decoder layer is built in transformers, and the class defaults that apply when a
# config.json leaves a field out (tie_word_embeddings, attention_bias). qk_norm: "head" normalises each head
# (Qwen3, Gemma 3: 2 x head_dim weights), "full" the whole q and k projections (OLMo 2). moe: the MLP is routed
# experts (3-D parameters in transformers 5, not nn.Linear) plus a router.
_DENSE = {"qkv_bias": False, "fused_qkv": False, "fused_gate_up": False, "qk_norm": None, "norms": 2, "tie": False,
          "moe": False}
ARCH_TRAITS: dict[str, dict] = {
    "llama": _DENSE,
    "mistral": _DENSE,
    "granite": _DENSE,
    "smollm3": {**_DENSE, "tie": True},
    "qwen2": {**_DENSE, "qkv_bias": True},
    "qwen3": {**_DENSE, "qk_norm": "head"},
    "qwen3_moe": {**_DENSE, "qk_norm": "head", "moe": True},
    "mixtral": {**_DENSE, "moe": True},
    # gpt-oss: biased q/k/v/o, a learned attention sink per head, biased experts and router (planner/moe.py)
    "gpt_oss": {**_DENSE, "qkv_bias": True, "o_bias": True, "sinks": True, "moe": True},
    # q/k norms per head when use_qk_norm (GLM-4.5), read from the config; the attention output is copied
    # (.contiguous()) before o_proj, so an fp32 o_proj adapter saves its own input
    "glm4_moe": {**_DENSE, "moe": True, "o_copy": True},
    "llama4_text": {**_DENSE, "moe": True},  # q/k L2 norms (no weights) when use_qk_norm, read from the config
    # Qwen3.5: Gated DeltaNet layers (planner/recurrent.py) among gated full-attention ones with q/k norms per head
    "qwen3_5_text": {**_DENSE, "qk_norm": "head", "gated": True, "linear": True},
    "qwen3_5_moe_text": {**_DENSE, "qk_norm": "head", "gated": True, "linear": True, "moe": True},
    "qwen3_next": {**_DENSE, "qk_norm": "head", "gated": True, "linear": True, "moe": True},  # fused projections
    # Gemma 4: sliding and full layers of their own head widths, per-layer inputs (planner/gemma4.py)
    "gemma4_text": {**_DENSE, "norms": 4, "tie": True, "qk_norm": "head", "gemma4": True, "sliding": 6},
    # Granite 4: Mamba2 layers (planner/recurrent.py) and attention, an MoE block with a shared MLP in every layer
    "granitemoehybrid": {**_DENSE, "linear": True, "moe": True},
    "olmo2": {**_DENSE, "qk_norm": "full"},
    # OLMo 3: OLMo 2's layer with sliding-window layers among the full ones (layer_types, sliding_window)
    "olmo3": {**_DENSE, "qk_norm": "full", "sliding": 4, "rope_fp32": True},  # its cos/sin stay fp32
    "phi3": {**_DENSE, "fused_qkv": True, "fused_gate_up": True},
    "gemma2": {**_DENSE, "norms": 4, "tie": True},
    "gemma3_text": {**_DENSE, "norms": 4, "tie": True, "qk_norm": "head"},
    # vision-language models' language models (task=vlm; tasks/vlm/planner/vlm.py sizes the vision side): a hub
    # config.json is flat (Qwen2-VL, Qwen2.5-VL) or nests a text_config (Qwen3-VL, transformers 5's own saves)
    "qwen2_vl": {**_DENSE, "qkv_bias": True},
    "qwen2_vl_text": {**_DENSE, "qkv_bias": True},
    "qwen2_5_vl": {**_DENSE, "qkv_bias": True},
    "qwen2_5_vl_text": {**_DENSE, "qkv_bias": True},
    "qwen3_vl": {**_DENSE, "qk_norm": "head"},
    "qwen3_vl_text": {**_DENSE, "qk_norm": "head"},
}
# Config fields that transform the head's output; rocktune's chunked loss does not reproduce them, so such a model
# takes the full-logits path (tasks/causal/loss.py's HEAD_TRANSFORMS, kept equal: the planner imports no torch code)
HEAD_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")
REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


@dataclass(frozen=True)
class ModelShape:
    name: str
    model_type: str
    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    tie_embeddings: bool
    qkv_bias: bool
    fused_qkv: bool
    fused_gate_up: bool
    qk_norm: bool
    norms_per_layer: int
    attn_softcap: float | None = None
    final_softcap: float | None = None
    qk_norm_full: bool = False  # OLMo 2: one norm over all heads' q (and k), not one per head
    experts: int = 0            # MoE: routed experts per layer (0: a dense MLP)
    experts_per_token: int = 0
    expert_intermediate: int = 0
    shared_intermediate: int = 0  # MoE: the always-on shared expert's width; the rest as planner/moe.MoeShape
    shared_gate: bool = False
    dense_layers: int = 0       # MoE models: layers with a dense MLP (of dense_intermediate) instead of experts
    dense_intermediate: int = 0
    expert_bias: bool = False
    router_bias: bool = False
    mxfp4_experts: bool = False  # the checkpoint's experts are MXFP4, dequantised at load (planner/moe.py)
    o_bias: bool = False        # the attention output projection has a bias (gpt-oss)
    attn_sinks: bool = False    # a learned sink logit per head and layer (gpt-oss)
    o_input_copy: bool = False  # the attention output reaches o_proj as a copy, not the kernel's own tensor
    rotary_fraction: float = 1.0  # of each head's dimensions that rotary embeddings turn (GLM-4.5: 0.5)
    sliding_layers: int = 0     # layers attending within a window (OLMo 3): a mask of their own past it
    sliding_window: int = 0
    rope_tables: int = 1        # cos/sin tables the model computes: one per attention kind with its own rotary
    rope_fp32: bool = False     # the rotary tables stay fp32 in a half-precision run (OLMo 3)
    gated_attn: bool = False    # full attention's output gated by sigmoid(a second half of q_proj) (Qwen3.5)
    linear_attn: recurrent.LinearAttn | None = None  # a hybrid's linear-attention layers (planner/recurrent.py)
    gemma4: gemma4.Gemma4Layout | None = None  # Gemma 4's layer kinds and per-layer inputs (planner/gemma4.py)
    head_transform: bool = False  # the logits are scaled or capped (HEAD_TRANSFORMS): the full-logits loss

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def mlp_width(self) -> int:
        """Intermediate activations per token: a dense MLP's width, or the routed experts' and the shared expert's
        together (MoE; what the routed rows save besides is planner/moe.saved)."""
        if self.experts:
            return self.experts_per_token * self.expert_intermediate + self.shared_intermediate
        return self.intermediate

    def linears(self) -> list[tuple[str, int, int, bool]]:
        """The linear modules of one (full-attention) decoder layer as (name, in, out, bias), named as in
        transformers. An MoE layer's experts are not nn.Linear (LoRA's all-linear and bitsandbytes leave them
        alone): attention and the shared expert's projections only (its 1-wide gate and the router are never
        adapted). A hybrid's linear-attention layers: ``layer_linears``."""
        h, q, kv = self.hidden, self.q_dim, self.kv_dim
        q_out = 2 * q if self.gated_attn else q  # Qwen3.5's q_proj also makes the output gate
        attn = [("qkv_proj", h, q + 2 * kv, self.qkv_bias)] if self.fused_qkv else [
            ("q_proj", h, q_out, self.qkv_bias), ("k_proj", h, kv, self.qkv_bias), ("v_proj", h, kv, self.qkv_bias)]
        return attn + [("o_proj", q, h, self.o_bias)] + self.mlp_linears()

    def mlp_linears(self) -> list[tuple[str, int, int, bool]]:
        h, i = self.hidden, self.intermediate
        if self.experts:
            return moe.shared_linears(self)
        mlp = [("gate_up_proj", h, 2 * i, False)] if self.fused_gate_up else [
            ("gate_proj", h, i, False), ("up_proj", h, i, False)]
        return mlp + [("down_proj", i, h, False)]

    def layer_linears(self) -> list[tuple[int, list[tuple[str, int, int, bool]]]]:
        """(layers, their linears) per kind of layer: full attention, and a hybrid's linear-attention layers."""
        la = self.linear_attn
        if self.gemma4 is not None:
            return [(k.layers, gemma4.linears(k, self.hidden, self.heads, self.gemma4.per_layer))
                    for k in self.gemma4.kinds]
        if la is None:
            return [(self.layers, self.linears())]
        kinds = [(self.layers - la.layers, self.linears()),
                 (la.layers, recurrent.linears(la, self.hidden) + self.mlp_linears())]
        return [(n, lin) for n, lin in kinds if n]

    def model_linears(self) -> list[tuple[str, int, int, bool]]:
        """Linear modules outside the decoder layers that all-linear adapts (the head never is)."""
        return gemma4.model_linears(self.gemma4, self.hidden, self.layers) if self.gemma4 else []

    def param_counts(self) -> dict[str, int]:
        if self.gemma4 is not None:
            return self._gemma4_counts()
        layers = 0
        for n, lin in self.layer_linears():
            layers += n * sum(n_in * n_out + (n_out if bias else 0) for _, n_in, n_out, bias in lin)
        attn_layers = self.layers - (self.linear_attn.layers if self.linear_attn else 0)
        layers += self.layers * self.norms_per_layer * self.hidden
        layers += attn_layers * (self._qk_norm_params() + (self.heads if self.attn_sinks else 0))
        layers += self.linear_attn.layers * recurrent.extra_params(self.linear_attn) if self.linear_attn else 0
        if self.experts:  # linears() holds the shared expert: MoE blocks add the rest, dense layers their MLP
            block, dense = moe.mlp_params(self)
            shared = sum(i * o for _, i, o, _ in moe.shared_linears(self))
            layers += self.moe_layers * (block - shared) + self.dense_layers * (dense - shared)
        embed = self.vocab * self.hidden
        return {"embed_tokens": embed, "layers": layers, "final_norm": self.hidden,
                "lm_head": 0 if self.tie_embeddings else embed}

    def _gemma4_counts(self) -> dict[str, int]:
        g, h = self.gemma4, self.hidden
        layers = sum(k.layers * (sum(i * o for _, i, o, _ in lin) + gemma4.layer_extra_params(k, h, g.per_layer))
                     for k, (_, lin) in zip(g.kinds, self.layer_linears()))
        embed = self.vocab * h
        extra = sum(i * o for _, i, o, _ in self.model_linears()) + gemma4.model_extra_params(g, self.layers)
        return {"embed_tokens": embed, "layers": layers, "per_layer_inputs": extra, "final_norm": h,
                "lm_head": 0 if self.tie_embeddings else embed}

    def _qk_norm_params(self) -> int:
        if not self.qk_norm or self.model_type == "llama4_text":  # Llama 4's is an L2 norm: saves, holds nothing
            return 0
        return self.q_dim + self.kv_dim if self.qk_norm_full else 2 * self.head_dim

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers if self.experts else 0

    @property
    def n_params(self) -> int:
        return sum(self.param_counts().values())

    @property
    def active_params(self) -> int:
        """Parameters one token computes with: all of a dense model; an MoE's routed share of its experts."""
        idle = self.experts - self.experts_per_token
        per_expert = 3 * self.hidden * self.expert_intermediate + (2 * self.expert_intermediate + self.hidden
                                                                   if self.expert_bias else 0)
        return self.n_params - self.moe_layers * idle * per_expert


@cache
def presets() -> dict[str, dict]:
    data = json.loads((Path(__file__).with_name("presets.json")).read_text())
    return {k: v for k, v in data.items() if not k.startswith("_")}


def load_shape(model: str) -> ModelShape:
    """``model``: a preset name (``Qwen2.5-3B``, also ``Qwen/Qwen2.5-3B-Instruct``), a config.json, or a model dir."""
    path = Path(model).expanduser()
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise UserError(f"{model} is a directory without a config.json; pass the model directory that "
                            "holds config.json, a config.json file, or a preset name.")
    if path.is_file():
        return shape_from_config(read_config(path), name=str(path))
    key = _preset_key(model)
    if key is None:
        raise UserError(f"unknown model {model!r}: not a file, not a directory with config.json, and not a preset. "
                        f"Known presets: {', '.join(presets())}.")
    return shape_from_config(presets()[key], name=key)


def _preset_key(model: str) -> str | None:
    wanted = model.rsplit("/", 1)[-1].lower()
    for suffix in ("-instruct", "-it", "-chat", "-base"):
        wanted = wanted.removesuffix(suffix)
    wanted = wanted.removesuffix("-v0.3").removesuffix("-v0.1").removesuffix("-4k").removesuffix("-128k")
    return next((k for k in presets() if k.lower() == wanted), None)


def shape_from_config(config: dict, name: str = "config") -> ModelShape:
    config = config.get("text_config", config) if "hidden_size" not in config else config
    model_type = config.get("model_type")
    if model_type not in ARCH_TRAITS:
        raise UserError(f"{name}: model_type {model_type!r} is not supported by the planner; supported: "
                        f"{', '.join(ARCH_TRAITS)}.")
    # an MoE family's config.json may size only its experts (Qwen3.5-MoE's has no intermediate_size)
    sized_by_experts = ARCH_TRAITS[model_type]["moe"] and config.get("moe_intermediate_size")
    optional = {"intermediate_size"} if sized_by_experts else set()
    missing = [k for k in REQUIRED if k not in optional and (not isinstance(config.get(k), int) or config[k] <= 0)]
    if missing:
        raise UserError(f"{name}: config.json is incomplete: {', '.join(missing)} missing or not a positive "
                        "integer.")
    traits = ARCH_TRAITS[model_type]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    if heads % kv_heads:
        raise UserError(f"{name}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}.")
    qkv_bias = traits["qkv_bias"] or bool(config.get("attention_bias", False))
    mo = moe.moe_shape(config, name) if traits["moe"] else None
    qk_norm = traits["qk_norm"] or ("head" if config.get("use_qk_norm", model_type == "llama4_text") and
                                    model_type in ("glm4_moe", "llama4_text") else None)
    return ModelShape(
        name=name, model_type=model_type, vocab=config["vocab_size"], hidden=config["hidden_size"],
        intermediate=config.get("intermediate_size") or mo.width, layers=config["num_hidden_layers"], heads=heads,
        kv_heads=kv_heads, head_dim=head_dim,
        tie_embeddings=bool(config.get("tie_word_embeddings", traits["tie"])), qkv_bias=qkv_bias,
        fused_qkv=traits["fused_qkv"], fused_gate_up=traits["fused_gate_up"], qk_norm=bool(qk_norm),
        norms_per_layer=traits["norms"], attn_softcap=config.get("attn_logit_softcapping"),
        final_softcap=config.get("final_logit_softcapping"), qk_norm_full=qk_norm == "full",
        o_bias=traits.get("o_bias", False), attn_sinks=traits.get("sinks", False),
        o_input_copy=traits.get("o_copy", False), rotary_fraction=_rotary_fraction(config), **_moe_fields(mo),
        rope_fp32=traits.get("rope_fp32", False),
        **(_sliding(config, traits["sliding"]) if traits.get("sliding") else {}),
        gated_attn=traits.get("gated", False),
        head_transform=any(config.get(k) not in (None, 1, 1.0) for k in HEAD_TRANSFORMS),
        gemma4=gemma4.layout(config, name) if traits.get("gemma4") else None,
        linear_attn=recurrent.linear_attn(config, name) if traits.get("linear") else None,
    )


def _sliding(config: dict, every: int) -> dict:
    """The layer kinds of OLMo 3 and Gemma 4: layer_types, or their config class's default (every ``every``-th layer
    full). Each kind present gets its own rotary table (the model computes one per kind, even when their bases
    agree)."""
    layers = config["num_hidden_layers"]
    kinds = config.get("layer_types") or ["sliding_attention" if (i + 1) % every else "full_attention"
                                          for i in range(layers)]
    sliding = sum(1 for k in kinds[:layers] if k == "sliding_attention")
    window = config.get("sliding_window") or 0
    return {"sliding_layers": sliding if window else 0, "sliding_window": window,
            "rope_tables": len(set(kinds[:layers]))}


def _rotary_fraction(config: dict) -> float:
    """partial_rotary_factor: top level in hub files, in rope_parameters in transformers 5's own saves."""
    rope = config.get("rope_parameters") if isinstance(config.get("rope_parameters"), dict) else {}
    value = config.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 1.0
    return float(value) if isinstance(value, (int, float)) and 0 < value <= 1 else 1.0


def _moe_fields(mo: moe.MoeShape | None) -> dict:
    if mo is None:
        return {}
    return {"experts": mo.experts, "experts_per_token": mo.per_token, "expert_intermediate": mo.width,
            "shared_intermediate": mo.shared, "shared_gate": mo.shared_gate, "dense_layers": mo.dense_layers,
            "dense_intermediate": mo.dense_width, "expert_bias": mo.expert_bias, "router_bias": mo.router_bias,
            "mxfp4_experts": mo.mxfp4}


def read_config(path: Path) -> dict:
    """A config.json as a dict, or a UserError naming the file (the LM and the Wan planner read theirs alike)."""
    from rocktune.readers.json_file import JsonProblem, parse_json

    try:
        config = parse_json(path.read_bytes())
    except (OSError, JsonProblem) as exc:  # JsonProblem: malformed, nested too deeply (the depth bound), ...
        raise UserError(f"{path} is not a readable JSON file: {exc}") from None
    if not isinstance(config, dict):
        raise UserError(f"{path} does not hold a JSON object; is it a Hugging Face config.json?")
    return config
