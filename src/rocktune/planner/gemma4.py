"""Gemma 4's text model from config.json: layers of two widths, and per-layer embeddings.

Its sliding layers attend with ``head_dim``, its full layers with ``global_head_dim`` (and
``num_global_key_value_heads`` where ``attention_k_eq_v``: then the full layers' values are their keys, no
``v_proj``); the last ``num_kv_shared_layers`` reuse an earlier layer's keys and values (no k/v projections, and with
``use_double_wide_mlp`` an MLP twice as wide). Every layer adds a per-layer input: a token's own embedding row
(``embed_tokens_per_layer``, ``hidden_size_per_layer_input`` per layer) mixed with a projection of the input
embedding (``per_layer_model_projection``, one Linear for the whole model, adapted by all-linear), gated into the
stream (``per_layer_input_gate``, ``per_layer_projection`` and a fifth norm). A Gemma 4 with an MoE block
(``enable_moe_block``) is refused: its experts are not counted here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from rocktune.errors import UserError


@dataclass(frozen=True)
class Kind:
    """One kind of Gemma 4 layer: how many, and what sizes its attention and MLP."""

    layers: int
    sliding: bool
    head_dim: int
    kv_heads: int
    own_kv: bool      # computes its keys and values (not a KV-shared layer)
    own_v: bool       # has a v_proj (not k_eq_v)
    mlp: int          # the MLP's intermediate width


@dataclass(frozen=True)
class Gemma4Layout:
    kinds: tuple[Kind, ...]
    per_layer: int       # hidden_size_per_layer_input (0: no per-layer inputs)
    per_layer_vocab: int  # vocab_size_per_layer_input


def layout(config: dict, name: str) -> Gemma4Layout:
    if config.get("enable_moe_block"):
        raise UserError(f"{name}: a Gemma 4 with an MoE block (enable_moe_block) is not supported by the planner "
                        "yet: its experts and router beside the MLP are not counted.")
    layers = config["num_hidden_layers"]
    types = list(config.get("layer_types") or ["sliding_attention" if (i + 1) % 6 else "full_attention"
                                               for i in range(layers)])[:layers]
    types[-1] = "full_attention"  # as the config class forces it
    shared_from = layers - (config.get("num_kv_shared_layers") or 0)
    kv, heads = config.get("num_key_value_heads") or config["num_attention_heads"], config["num_attention_heads"]
    k_eq_v = bool(config.get("attention_k_eq_v"))
    full_kv = (config.get("num_global_key_value_heads") or kv) if k_eq_v else kv
    full_dim = config.get("global_head_dim") or 512
    width = config["intermediate_size"]
    # a saved config carries the full layers' sizes per layer (per_layer_config); a hub file the config's fields
    overrides = {int(k): v for k, v in (config.get("per_layer_config") or {}).items()}
    if not overrides:
        overrides = {i: {"head_dim": full_dim, "num_key_value_heads": full_kv} for i, t in enumerate(types)
                     if t == "full_attention"}
    counts: dict[Kind, int] = {}
    for i, t in enumerate(types):
        sliding, own = t == "sliding_attention", i < shared_from
        sizes = overrides.get(i) or {}
        kind = Kind(0, sliding, sizes.get("head_dim") or config.get("head_dim") or 256,
                    sizes.get("num_key_value_heads") or kv, own, own and not (k_eq_v and not sliding),
                    width * (2 if config.get("use_double_wide_mlp") and not own else 1))
        counts[kind] = counts.get(kind, 0) + 1
    if any(heads % k.kv_heads for k in counts):
        raise UserError(f"{name}: num_attention_heads={heads} is not a multiple of its key/value heads.")
    per_layer = config.get("hidden_size_per_layer_input") or 0
    return Gemma4Layout(kinds=tuple(replace(k, layers=n) for k, n in counts.items()),
                        per_layer=per_layer, per_layer_vocab=config.get("vocab_size_per_layer_input") or 0)


def linears(kind: Kind, hidden: int, heads: int, per_layer: int) -> list[tuple[str, int, int, bool]]:
    """One layer of ``kind``: its linear modules as (name, in, out, bias)."""
    q, kv = heads * kind.head_dim, kind.kv_heads * kind.head_dim
    out = [("q_proj", hidden, q, False)]
    out += [("k_proj", hidden, kv, False)] if kind.own_kv else []
    out += [("v_proj", hidden, kv, False)] if kind.own_v else []
    out += [("o_proj", q, hidden, False), ("gate_proj", hidden, kind.mlp, False), ("up_proj", hidden, kind.mlp, False),
            ("down_proj", kind.mlp, hidden, False)]
    if per_layer:
        out += [("per_layer_input_gate", hidden, per_layer, False), ("per_layer_projection", per_layer, hidden, False)]
    return out


def layer_extra_params(kind: Kind, hidden: int, per_layer: int) -> int:
    """Besides the linears: four sandwich norms (a fifth after the per-layer input), q and k norms (v's has no
    weight)."""
    return (4 + bool(per_layer)) * hidden + kind.head_dim * (1 + kind.own_kv)


def model_linears(lay: Gemma4Layout, hidden: int, layers: int) -> list[tuple[str, int, int, bool]]:
    """Linear modules outside the layers: the projection of the input embedding to every layer's per-layer input."""
    return [("per_layer_model_projection", hidden, layers * lay.per_layer, False)] if lay.per_layer else []


def model_extra_params(lay: Gemma4Layout, layers: int) -> int:
    """The per-layer embedding table and the per-layer inputs' norm."""
    return lay.per_layer_vocab * layers * lay.per_layer + lay.per_layer if lay.per_layer else 0


def saved_extra(shape, kind: Kind, tok) -> int:
    """What a Gemma 4 layer saves beyond the standard layer model's (activations.layer_saved), counted with
    saved_tensors_hooks (benchmarks/planner_validation.py --families): its RMSNorm keeps two per-row statistics
    (the mean square and its power, not one rsqrt), v has a norm of its own, and the per-layer input keeps the
    fifth norm's fp32 input, the gate adapter's input (the stream), the gate's output, its GELU, the layer's slice of
    the per-layer inputs and the product (per_layer_projection's input), and two more adapters' rank-r outputs."""
    t, dt, r, h, hp = tok.t, tok.dt, tok.rank, shape.hidden, shape.gemma4.per_layer
    lin = 4 if not tok.amp else dt  # an adapter's saved input: fp32, or its own half cast under autocast
    out = t * 4 * (4 + 1 + shape.heads)  # the second statistic of the 4 sandwich norms, (the fifth's below), q's
    if kind.own_kv:  # k's second statistic; v's norm: its fp32 input and both statistics
        out += t * 4 * kind.kv_heads + t * kind.kv_heads * (4 * kind.head_dim + 8)
    if hp:
        out += t * (4 * h + 8) + t * h * lin + 3 * t * hp * (tok.stream or dt) + t * hp * lin
        out += 2 * t * r * dt + (2 * (h + hp) * r * dt if tok.amp else 0)
    return out


def saved_outside(shape, tok, checkpointing: bool) -> int:
    """The per-layer inputs' saved bytes outside the layers: the input embedding (per_layer_model_projection's
    adapter input) and a second copy of its width, the per-layer norm's fp32 input and statistics, the adapter's
    rank-r output; under checkpointing the layers' per-layer inputs instead, kept as the checkpoints' arguments."""
    g = shape.gemma4
    if not g.per_layer:
        return 0
    t, dt, per = tok.t, tok.dt, shape.layers * g.per_layer
    if checkpointing:  # the input embedding is the first checkpoint's input (counted there) unless cast for the adapter
        embed = t * per * (tok.stream or dt) + (t * shape.hidden * dt if tok.amp else 0)
    else:
        embed = 2 * t * shape.hidden * 4
    return embed + t * per * 4 + 2 * t * shape.layers * 4 + t * tok.rank * dt + (
        (shape.hidden + per) * tok.rank * dt if tok.amp else 0)


def rope_values(shape, seq: int) -> int:
    """cos and sin per position of each kind of layer: the sliding layers' over their head width, the full layers'
    (proportional rope: the unrotated dimensions kept as ones and zeros) over theirs."""
    widths = {k.sliding: k.head_dim for k in shape.gemma4.kinds}
    return sum(2 * seq * w for w in widths.values())
