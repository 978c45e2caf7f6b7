"""Checkpoints whose MoE experts ship as MXFP4 (the released gpt-oss-20b/120b): dequantised at load for LoRA.

Such a checkpoint says ``quantization_config: {quant_method: mxfp4}`` in config.json and stores each expert stack as
``<stack>_blocks`` (two FP4 e2m1 values a byte) and ``<stack>_scales`` (one e8m0 exponent per 32 values): 4.25 bits a
value. transformers (quantizers/quantizer_mxfp4.py) keeps them packed only where it can run its Triton MXFP4 kernels
(a CUDA GPU of compute capability 7.5 or later, or an XPU, with triton and the ``kernels`` package) and otherwise
dequantises them as it loads, to the model's dtype: on every CPU, and on every GPU without those kernels. rocktune
always asks for the dequantised stacks (``Mxfp4Config(dequantize=True)``), on every device alike: the kernels compute
the forward pass only (transformers' quantizer reports MXFP4 as not trainable), and the expert LoRA (lora/moe.py)
reads each stack as a tensor. The decoding is exact (an e2m1 value times a power of two fits bf16 and fp32), so the
model trains on the checkpoint's own values; the cost is memory, which the run log states from the checkpoint's own
bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rocktune.dtypes import canonical
from rocktune.errors import UserError, first_line

METHOD = "mxfp4"
PACKED = ("_blocks", "_scales")  # the two tensors a checkpoint stores for each MXFP4 stack


def quant_config(name_or_path: str) -> dict | None:
    """config.json's ``quantization_config`` when it says MXFP4, else None (no config.json found: None, the
    loader speaks)."""
    from rocktune.readers.json_file import read_json

    file = _checkpoint_file(name_or_path, "config.json")
    if file is None:
        return None
    config = read_json(file, "re-download the model, or point model.name_or_path at a complete copy.")
    found = config.get("quantization_config") if isinstance(config, dict) else None
    return found if isinstance(found, dict) and found.get("quant_method") == METHOD else None


def load_kwargs(name_or_path: str, quantization: str) -> dict:
    """What ``from_pretrained`` needs for this checkpoint: nothing for an unquantised one; for MXFP4 experts, the
    dequantising config (module docstring). A bitsandbytes ``model.quantization`` is refused: transformers loads one
    quantisation method at a time, and this checkpoint already names MXFP4."""
    found = quant_config(name_or_path)
    if found is None:
        return {}
    if quantization != "none":
        raise UserError(f"model.quantization={quantization} with {name_or_path}: its experts are stored as MXFP4 "
                        "(config.json quantization_config), and transformers cannot load that with bitsandbytes "
                        "on top. Set model.quantization: none (rocktune dequantises the experts for LoRA; `rocktune "
                        "plan` shows the memory it takes), or train from a bf16 copy of the checkpoint, which "
                        f"model.quantization: {quantization} then quantises.")
    from transformers import Mxfp4Config

    return {"quantization_config": Mxfp4Config(dequantize=True,
                                               modules_to_not_convert=found.get("modules_to_not_convert"))}


@dataclass(frozen=True)
class ExpertBytes:
    """The MXFP4 stacks of a checkpoint, packed on disk and dequantised in memory."""
    stacks: int        # stack tensors (a layer's gate_up and down are two)
    values: int        # their values
    packed: int        # bytes of their blocks and scales in the checkpoint
    dequantised: int   # bytes they hold once dequantised
    dtype: str         # the dtype they were dequantised to

    def note(self) -> str:
        return (f"MXFP4 experts dequantised for LoRA: {self.stacks} expert stacks, {self.values:,} values, "
                f"{size(self.dequantised)} as {self.dtype} in memory against {size(self.packed)} as MXFP4 in the "
                f"checkpoint ({self.dequantised / self.packed:.2f}x, +{size(self.dequantised - self.packed)}); "
                "transformers' MXFP4 kernels compute the forward pass only, and the expert LoRA reads the stacks "
                "as tensors")


def expert_bytes(name_or_path: str, model) -> ExpertBytes | None:
    """What dequantising cost ``model`` (loaded from ``name_or_path``), None for a checkpoint without MXFP4 stacks.
    The packed bytes are the checkpoint's (its safetensors headers); the dequantised ones the model's parameters."""
    packed = packed_stacks(name_or_path)
    if not packed:
        return None
    params = dict(model.named_parameters())
    found = [p for name, p in params.items() if _stack_name(name) in packed]
    if not found:
        return None
    return ExpertBytes(len(found), sum(p.numel() for p in found), sum(packed.values()),
                       sum(p.numel() * p.element_size() for p in found), str(canonical(str(found[0].dtype))))


def load_note(name_or_path: str, model) -> str | None:
    """The run log's line on the dequantised experts (None when the checkpoint has none)."""
    if quant_config(name_or_path) is None:
        return None
    found = expert_bytes(name_or_path, model)
    return found.note() if found is not None else None


def packed_stacks(name_or_path: str) -> dict[str, int]:
    """{stack parameter name: bytes of its blocks and scales} from the checkpoint's safetensors headers (no tensor
    is read)."""
    from safetensors import safe_open

    out: dict[str, int] = {}
    for file in weight_files(name_or_path):
        try:
            with safe_open(str(file), framework="numpy") as f:
                for key in f.keys():
                    if key.endswith(PACKED):
                        part = f.get_slice(key)
                        n = 1
                        for d in part.get_shape():
                            n *= d
                        stack = key.rsplit("_", 1)[0]
                        out[stack] = out.get(stack, 0) + n  # both parts are uint8: a byte a value
        except OSError as exc:
            raise UserError(f"could not read {file}: {first_line(exc)}; re-download the model.") from None
    return out


def _stack_name(param: str) -> str:
    """A loaded parameter's name as the checkpoint names it (PEFT's wrappers add ``base_layer`` and a prefix)."""
    return param.replace(".base_layer", "").replace("base_model.model.", "", 1)


def weight_files(name_or_path: str) -> list[Path]:
    """The checkpoint's safetensors files: its index's shards, or its one file."""
    from rocktune.readers.json_file import read_json

    index = _checkpoint_file(name_or_path, "model.safetensors.index.json")
    if index is not None:
        shards = sorted(set(read_json(index, "re-download the model.").get("weight_map", {}).values()))
        return [f for f in (_checkpoint_file(name_or_path, s) for s in shards) if f is not None]
    single = _checkpoint_file(name_or_path, "model.safetensors")
    return [single] if single is not None else []


def _checkpoint_file(name_or_path: str, filename: str) -> Path | None:
    """A file of a local model directory, or of a hub model (through the cache; None when it cannot be had)."""
    if not name_or_path:  # a model built in memory names no checkpoint (and "" would be the working directory)
        return None
    local = Path(name_or_path).expanduser()
    if local.is_dir():
        return local / filename if (local / filename).is_file() else None
    from transformers.utils import cached_file

    try:
        found = cached_file(name_or_path, filename, _raise_exceptions_for_missing_entries=False,
                            _raise_exceptions_for_connection_errors=False)
    except (OSError, ValueError):  # not a hub id at all: the loader says so with its fix
        return None
    return Path(found) if found else None


def size(n: int) -> str:
    """Bytes as people read them: GiB from 1 GiB up, MiB from 1 MiB, else KiB."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n / 2**10:.1f} KiB"
