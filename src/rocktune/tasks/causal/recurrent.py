"""Packed rows on a model with recurrent layers: refused before the first step, or (batching auto) not chosen.

Packing puts several examples in one row and keeps them apart with attention masks or document bounds. A Gated
DeltaNet or Mamba2 layer has no mask: its state and its short convolution run on from one example into the next,
so every packed example after the first would be trained on a state its own text never produced. Keeping them apart
needs the layer's kernel to take the document bounds (flash-linear-attention's and mamba-ssm's do; transformers'
reference path refuses them), a path rocktune does not drive or prove yet.
"""

from __future__ import annotations

from rocktune.errors import UserError
from rocktune.models.recurrent import describe, kernel_note, recurrent_layers
from rocktune.tasks.causal.feed import resolve_mode


def unpacked(cfg, device: str):
    """``(cfg, notes)``: ``cfg`` as given, or with ``training.batching=examples`` where auto would pack on this
    device; a UserError where the config asks for packed rows explicitly. The notes also say when the layers run
    on transformers' reference kernels."""
    m, t, d = cfg.model, cfg.training, cfg.data
    layers = recurrent_layers(m.name_or_path, m.trust_remote_code)
    notes = [n for n in (kernel_note(layers),) if n]
    if not (layers and (d.packing or resolve_mode(t.batching, device) == "tokens")):
        return cfg, notes
    why = (f"{m.name_or_path} has recurrent layers ({describe(layers)}) whose state and short convolution would run "
           "on from one packed example into the next (rocktune does not keep packed examples apart in them yet)")
    if d.packing:
        raise UserError(f"data.packing=true: {why}. Set data.packing: false (padded micro-batches train it "
                        "correctly).")
    if t.batching == "tokens":
        raise UserError(f"training.batching=tokens packs examples into rows: {why}. Set training.batching: examples "
                        "(or auto).")
    fitted = cfg.model_copy(deep=True)
    fitted.training.batching = "examples"
    return fitted, notes + [f"batching: examples, not the packed rows auto picks on this device: {why}"]
