"""llama.cpp's own HF -> GGUF converter (``convert_hf_to_gguf.py``), run from an unpacked llama.cpp source tree, as
the reference our GGUF export is compared with tensor for tensor (tests/test_gguf_converter.py).

``make llama-cpp`` unpacks the source package of the llama-cpp-python it installs into ``.venv/llama-cpp-src`` (CI
runs it); elsewhere point ``ROCKTUNE_LLAMA_CPP_SRC`` at a ``vendor/llama.cpp`` of the installed version, e.g. from
``pip download --no-deps --no-binary llama-cpp-python llama-cpp-python==0.3.36 -d /tmp/lcpp``, untarred there.

Run as a script it is the converter's command line, with one change: the tiny test tokenizers are not among the
released ones whose pre-tokenizer the converter recognises by a hash of their output, so the name is given.
"""

from __future__ import annotations

import os
import runpy
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SEARCHED = (str(ROOT / ".venv" / "llama-cpp-src" / "llama_cpp_python-*" / "vendor" / "llama.cpp"),
            "/tmp/lcpp/llama_cpp_python-*/vendor/llama.cpp")


def converter_source() -> Path | None:
    """The llama.cpp source tree holding convert_hf_to_gguf.py, or None."""
    if os.environ.get("ROCKTUNE_LLAMA_CPP_SRC"):
        found = [Path(os.environ["ROCKTUNE_LLAMA_CPP_SRC"])]
    else:
        found = sorted(p for pattern in SEARCHED for p in Path("/").glob(pattern.lstrip("/")))
    return next((p for p in reversed(found) if (p / "convert_hf_to_gguf.py").is_file()), None)


# families whose checkpoints carry multi-token-prediction layers that transformers' model leaves out: a merge has
# none, so the converter is told so (without it, it counts layers the file does not hold, or fails)
NO_MTP = {"glm4_moe", "qwen3_5_text", "qwen3_5_moe_text", "qwen3_next"}


def convert(src: Path, model_dir: Path, out: Path, outtype: str, pre: str,
            model_type: str) -> subprocess.CompletedProcess:
    """The converter on ``model_dir`` (this venv's python; the converter's own gguf-py, as it loads by default)."""
    argv = [sys.executable, __file__, str(src), pre, str(model_dir), "--outtype", outtype, "--outfile", str(out)]
    argv += ["--no-mtp"] if model_type in NO_MTP else []
    return subprocess.run(argv, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def _main() -> None:
    src, pre = sys.argv[1], sys.argv[2]
    script = str(Path(src) / "convert_hf_to_gguf.py")
    sys.argv = [script, *sys.argv[3:]]
    sys.path.insert(0, src)
    from conversion import base  # the converter's package, importable once its directory is on the path

    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    _main()
