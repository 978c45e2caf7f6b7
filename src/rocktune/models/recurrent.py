"""Layers that carry state along the sequence (Gated DeltaNet's linear attention in Qwen3.5 / Qwen3-Next, Mamba2 in
Granite 4): read from config.json's ``layer_types``, for what rocktune must not do with them yet (packed rows:
tasks/causal/recurrent.py) and the run log's word on their kernels before the model loads. Which kernels a loaded
model's layers run is chosen, and self-tested on the device, by rocktune.kernels.recurrent."""

from __future__ import annotations

# layer_types values that are attention (each token attends to the tokens before it, masks keep documents apart)
ATTENTION = {"full_attention", "sliding_attention", "chunked_attention", "attention"}


def recurrent_layers(name_or_path: str, trust_remote_code: bool) -> dict[str, list[int]]:
    """{layer kind: layer indices} of the model's layers that are not attention (empty for a plain transformer, an
    unreadable config or custom code: the loader reports those)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(name_or_path, trust_remote_code=trust_remote_code).get_text_config()
    except Exception:  # noqa: BLE001 -- an unknown architecture, a missing file: model loading says what is wrong
        return {}
    found: dict[str, list[int]] = {}
    for i, kind in enumerate(getattr(config, "layer_types", None) or ()):
        if isinstance(kind, str) and kind not in ATTENTION:
            found.setdefault(kind, []).append(i)
    return found


# layer kind -> the packages whose kernels transformers uses for it when importable (else its torch reference path;
# where they are, rocktune.kernels.recurrent keeps each one that passes its self-test on the device)
KERNELS = {"linear_attention": ("fla", "causal_conv1d"), "mamba": ("mamba_ssm", "causal_conv1d")}


def kernel_note(layers: dict[str, list[int]]) -> str | None:
    """The run log's line when a recurrent layer kind runs on transformers' torch reference kernels because their
    packages are not installed (transformers' own warning is silenced with the rest of its logging): correct, much
    slower (benchmarks/mamba_reference_scan.py). Installed, the loader's self-tests say which run
    (rocktune.kernels.recurrent)."""
    import importlib.util

    missing = sorted({p for kind in layers for p in KERNELS.get(kind, ()) if importlib.util.find_spec(p) is None})
    if not missing:
        return None
    return (f"kernels: the {', '.join(layers)} layers run transformers' torch reference path ({', '.join(missing)} "
            "not installed): correct, slower")


def describe(layers: dict[str, list[int]]) -> str:
    return "; ".join(f"{kind} in layers {', '.join(map(str, idx))}" for kind, idx in layers.items())
