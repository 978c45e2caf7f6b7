"""Check a local model directory before anything is loaded or written: config.json, every weight file (the
safetensors headers parsed and the file sizes compared with them, shard indexes against the files they name) and
the tokenizer files. Each problem is one ``UserError`` naming the file and what to do; no weights are read.

A hub id is left to the loader (it resolves, or says it cannot); only directories on this machine are checked here.
No torch: the safetensors library reads headers on its own.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

from rocktune.errors import UserError, first_line
from rocktune.readers.json_file import read_json
from rocktune.readers.safetensors_file import check_safetensors

INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model",
                   "sentencepiece.bpe.model", "tokenizer.tiktoken")
REDOWNLOAD = "re-download the model (or copy the file again), or point model.name_or_path at a complete copy"


def check_model_dir(name_or_path: str, tokenizer: bool = True) -> int | None:
    """Raise on a broken local model directory; return its vocabulary size (None for a hub id or when unknown).
    ``tokenizer=False`` leaves the tokenizer files to the caller (export says which one it needs itself)."""
    path = Path(name_or_path).expanduser()
    if not path.is_dir():
        return None
    config = _config(path)
    _weights(path)
    if tokenizer:
        _tokenizer_files(path)
    vocab = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    return vocab if isinstance(vocab, int) else None


def _config(path: Path) -> dict:
    file = path / "config.json"
    if not file.is_file():
        raise UserError(f"model directory {path} has no config.json, so it is not a complete Hugging Face model "
                        f"directory (an interrupted download, or the wrong directory); {REDOWNLOAD}.")
    return read_json(file, f"{REDOWNLOAD}.")


def _weights(path: Path) -> None:
    for name in INDEXES:
        if (path / name).is_file():
            for file in _shards(path / name):
                _check_weight_file(file)
            return
    files = sorted(path.glob("*.safetensors")) + sorted(path.glob("*.bin"))
    files = [f for f in files if not f.name.startswith(("adapter_", "training_args"))]
    if not files:
        raise UserError(f"model directory {path} holds no weights (no *.safetensors or pytorch_model.bin, and no "
                        f"shard index); {REDOWNLOAD}.")
    for file in files:
        _check_weight_file(file)


def _shards(index: Path) -> list[Path]:
    index_data = read_json(index, f"{REDOWNLOAD}.")
    try:
        names = sorted(set(index_data["weight_map"].values()))
    except (KeyError, TypeError, AttributeError) as exc:
        raise UserError(f"{index} cannot be read as a shard index ({first_line(exc)}); {REDOWNLOAD}.") from None
    missing = [n for n in names if not (index.parent / n).is_file()]
    if missing:
        raise UserError(f"{index} names {len(missing)} weight file(s) that are not in {index.parent} "
                        f"({', '.join(missing[:3])}{' …' if len(missing) > 3 else ''}); the download is incomplete: "
                        f"{REDOWNLOAD}.")
    return [index.parent / n for n in names]


def _check_weight_file(file: Path) -> None:
    if file.suffix == ".safetensors":
        check_safetensors(file, f"{REDOWNLOAD}.")
    elif file.stat().st_size == 0:
        raise UserError(f"{file} is empty (an interrupted download?); {REDOWNLOAD}.")
    elif _looks_zip(file) and not zipfile.is_zipfile(file):
        raise UserError(f"{file} is truncated or damaged (the end of its zip archive is missing); {REDOWNLOAD}.")


def _looks_zip(file: Path) -> bool:
    with open(file, "rb") as f:
        return f.read(4) == b"PK\x03\x04"  # starts like torch's zip format, yet its end is gone


def _tokenizer_files(path: Path) -> None:
    config_file = path / "tokenizer_config.json"
    if config_file.is_file() and "AutoTokenizer" in (read_json(config_file, f"{REDOWNLOAD}.").get("auto_map") or {}):
        return  # remote code brings its own tokenizer and names its own files
    if any((path / f).is_file() for f in TOKENIZER_FILES) or any(path.glob("*.tiktoken")):
        return
    raise UserError(f"model directory {path} has no tokenizer files (none of {', '.join(TOKENIZER_FILES[:4])}, …), "
                    "so text cannot be turned into tokens; copy the tokenizer files from the model's original "
                    "repository into it, or point model.name_or_path at the complete download.")



def shape_mismatches(name_or_path: str, model_class, config, limit: int = 3) -> list[str]:
    """Weights whose stored shape differs from what ``config`` builds (a meta-device model: no memory, no weights),
    as "name: file [..], config [..]" lines; empty when they agree or the files cannot be read."""
    import torch
    from safetensors import safe_open

    path = Path(name_or_path)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
    if not files:
        return []
    with torch.device("meta"):
        expected = {k: list(v.shape) for k, v in model_class.from_config(config).state_dict().items()}
    out = []
    for file in files:
        with safe_open(str(file), framework="numpy") as f:
            for key in f.keys():
                stored = list(f.get_slice(key).get_shape())
                if key in expected and expected[key] != stored:
                    out.append(f"{key}: file {stored}, config.json {expected[key]}")
                    if len(out) >= limit:
                        return out
    return out
