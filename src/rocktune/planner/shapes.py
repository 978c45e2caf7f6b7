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

# Per model_type: how the decoder layer is built in transformers, and the class defaults that apply when a
# config.json leaves a field out (tie_word_embeddings, attention_bias).
ARCH_TRAITS: dict[str, dict] = {
    "llama": {"qkv_bias": False, "fused_qkv": False, "fused_gate_up": False, "qk_norm": False, "norms": 2,
              "tie": False},
    "mistral": {"qkv_bias": False, "fused_qkv": False, "fused_gate_up": False, "qk_norm": False, "norms": 2,
                "tie": False},
    "qwen2": {"qkv_bias": True, "fused_qkv": False, "fused_gate_up": False, "qk_norm": False, "norms": 2,
              "tie": False},
    "qwen3": {"qkv_bias": False, "fused_qkv": False, "fused_gate_up": False, "qk_norm": True, "norms": 2,
              "tie": False},
    "phi3": {"qkv_bias": False, "fused_qkv": True, "fused_gate_up": True, "qk_norm": False, "norms": 2,
             "tie": False},
    "gemma2": {"qkv_bias": False, "fused_qkv": False, "fused_gate_up": False, "qk_norm": False, "norms": 4,
               "tie": True},
}
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

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def linears(self) -> list[tuple[str, int, int, bool]]:
        """The linear modules of one decoder layer as (name, in, out, bias), named as in transformers."""
        h, i, q, kv = self.hidden, self.intermediate, self.q_dim, self.kv_dim
        attn = [("qkv_proj", h, q + 2 * kv, self.qkv_bias)] if self.fused_qkv else [
            ("q_proj", h, q, self.qkv_bias), ("k_proj", h, kv, self.qkv_bias), ("v_proj", h, kv, self.qkv_bias)]
        mlp = [("gate_up_proj", h, 2 * i, False)] if self.fused_gate_up else [
            ("gate_proj", h, i, False), ("up_proj", h, i, False)]
        return attn + [("o_proj", q, h, False)] + mlp + [("down_proj", i, h, False)]

    def param_counts(self) -> dict[str, int]:
        layer = sum(n_in * n_out + (n_out if bias else 0) for _, n_in, n_out, bias in self.linears())
        layer += self.norms_per_layer * self.hidden + (2 * self.head_dim if self.qk_norm else 0)
        embed = self.vocab * self.hidden
        return {"embed_tokens": embed, "layers": layer * self.layers, "final_norm": self.hidden,
                "lm_head": 0 if self.tie_embeddings else embed}

    @property
    def n_params(self) -> int:
        return sum(self.param_counts().values())


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
    missing = [k for k in REQUIRED if not isinstance(config.get(k), int) or config[k] <= 0]
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
    return ModelShape(
        name=name, model_type=model_type, vocab=config["vocab_size"], hidden=config["hidden_size"],
        intermediate=config["intermediate_size"], layers=config["num_hidden_layers"], heads=heads,
        kv_heads=kv_heads, head_dim=head_dim,
        tie_embeddings=bool(config.get("tie_word_embeddings", traits["tie"])), qkv_bias=qkv_bias,
        fused_qkv=traits["fused_qkv"], fused_gate_up=traits["fused_gate_up"], qk_norm=traits["qk_norm"],
        norms_per_layer=traits["norms"], attn_softcap=config.get("attn_logit_softcapping"),
        final_softcap=config.get("final_logit_softcapping"),
    )


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
