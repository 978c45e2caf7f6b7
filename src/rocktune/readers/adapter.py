"""A PEFT LoRA adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``), the one reader that
``export``, ``generate`` and the export writers go through. The config is parsed with the depth-bounded JSON reader
and its fields that rocktune and PEFT act on are checked for their types (PEFT itself would fail deep inside a merge
with a ``TypeError``); the weights file must be there and its header must describe the file exactly. Tensor shapes
need the base model and are compared in ``export/source.py``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rocktune.errors import UserError
from rocktune.readers.json_file import read_json
from rocktune.readers.safetensors_file import check_safetensors

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"


@dataclass(frozen=True)
class Adapter:
    path: Path
    config: dict     # adapter_config.json, its fields checked
    weights: Path    # adapter_model.safetensors, its header checked


def read_adapter(path: Path, fix: str) -> Adapter:
    """The adapter at ``path`` or one ``UserError`` naming the file at fault and ending in ``fix``."""
    path = Path(path)
    config = read_adapter_config(path, fix)
    weights = path / WEIGHTS
    if not weights.is_file():
        raise UserError(f"{weights} is missing: {path} has {CONFIG} but no weights, so the adapter is incomplete "
                        "(a run stopped while writing it: `rocktune train -c RUN/config.yaml --resume` writes it "
                        f"again); {fix}")
    check_safetensors(weights, fix)
    return Adapter(path, config, weights)


def read_adapter_config(path: Path, fix: str) -> dict:
    """``adapter_config.json`` of the adapter directory ``path``, a JSON object whose LoRA fields have their types."""
    file = Path(path) / CONFIG
    config = read_json(file, fix)
    problem = _field_problem(config)
    if problem:
        raise UserError(f"{file}: {problem}, which PEFT cannot use; {fix}")
    return config


def names(config: dict, field: str) -> list[str]:
    """``target_modules`` or ``modules_to_save`` as a list (PEFT allows one string, a list, or none)."""
    value = config.get(field) or []
    return [value] if isinstance(value, str) else list(value)


def _field_problem(config: dict) -> str | None:
    r = config.get("r", 8)
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        return f"r is {r!r}, not a positive integer"
    alpha = config.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        return f"lora_alpha is {alpha!r}, not a number"
    for field in ("target_modules", "modules_to_save"):
        value = config.get(field)
        if value is not None and not isinstance(value, str) and not (
                isinstance(value, list) and all(isinstance(v, str) for v in value)):
            return f"{field} is {value!r}, not a module name or a list of them"
    base = config.get("base_model_name_or_path")
    if base is not None and not isinstance(base, str):
        return f"base_model_name_or_path is {base!r}, not a string"
    return None
