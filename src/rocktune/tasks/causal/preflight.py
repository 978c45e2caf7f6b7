"""Check, then write: what can reject a run is checked before the run directory or any cache is created.

The order in ``train``: the config (already validated by ``config.load_config``), the platform (``resolve_auto``),
then ``check_run`` here — data files present, platform gates of the chosen kernels, the model directory
(``models/check.py``) — then ``load_tokenizer`` here, then ``prepare_data``, which reads, validates and tokenises every
data file, splits, and runs the data checks before it writes its cache. Anything a check raises is a ``UserError``:
one paragraph and exit 2, never a crash for the supervisor to retry.
"""

from __future__ import annotations

import importlib.util

from rocktune.models import check as modelcheck
from rocktune.kernels.attention import varlen_gate
from rocktune.data import sources
from rocktune.errors import UserError, first_line
from rocktune.models.load import check_model_source, check_weight_shapes
from rocktune.models.load import load_tokenizer as _load_tokenizer

PROBE = "Hello, world. 123"


def check_run(name_or_path: str, train_file: str, eval_file: str | None, device: str, liger: str,
              attn_implementation: str) -> int | None:
    """Raise on anything that would stop the run later; return the model's vocabulary size when it is known."""
    for key, file in (("data.train_file", train_file), ("data.eval_file", eval_file)):
        if file:
            sources.check_spec(file, key)
    gates(device, liger, attn_implementation)
    check_model_source(name_or_path)
    try:
        vocab = modelcheck.check_model_dir(name_or_path)
        check_weight_shapes(name_or_path)
        return vocab
    except OSError as exc:  # a permission or I/O error on a file the checks open
        raise UserError(f"the model directory {name_or_path} cannot be read ({exc}); check its permissions and "
                        "the disk.") from None


def liger_gate(device: str, liger: str) -> None:
    """``model.liger=on`` where Liger cannot run: refused here before the data is tokenised, and again where the
    kernels are applied (``build.liger``), for callers that skip the preflight."""
    if liger == "on" and device != "cuda":
        raise UserError("model.liger=on needs a ROCm or CUDA device (Liger kernels are Triton GPU kernels); "
                        "use model.liger=auto or off on CPU.")
    if liger == "on" and importlib.util.find_spec("liger_kernel") is None:
        raise UserError("model.liger=on but liger-kernel is not installed: pip install 'rocktune[liger]'.")


def gates(device: str, liger: str, attn_implementation: str) -> None:
    """Kernels this machine cannot run. The same refusals stand where the kernels are applied (``build.liger``,
    ``model.load_model``); here they come before the data is tokenised."""
    liger_gate(device, liger)
    if attn_implementation == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        raise UserError("model.attn_implementation=flash_attention_2 needs the flash-attn package, which is not "
                        "installed; use sdpa (the default) or install flash-attn for your GPU.")
    if attn_implementation == "varlen":
        varlen_gate(device)


def load_tokenizer(name_or_path: str, trust_remote_code: bool):
    """The tokenizer, proven to turn text into tokens: a damaged tokenizer.json raises from deep inside the
    tokenizers library, and a directory without tokenizer files can load an empty one that maps everything to
    nothing (the data check would then blame the data)."""
    try:
        tokenizer = _load_tokenizer(name_or_path, trust_remote_code)
        ids = tokenizer(PROBE, add_special_tokens=False)["input_ids"]
    except UserError:
        raise
    except Exception as exc:  # noqa: BLE001 — whatever the tokenizer libraries raise, the files are the cause
        text = first_line(exc)
        raise UserError(f"the tokenizer of {name_or_path} does not load ({type(exc).__name__}: {text}); its "
                        f"tokenizer files are damaged or incomplete: {modelcheck.REDOWNLOAD}.") from None
    if not ids or len(tokenizer) < 2:
        raise UserError(f"the tokenizer of {name_or_path} turns text into no tokens (vocabulary of {len(tokenizer)}); "
                        f"its tokenizer files are missing or empty: {modelcheck.REDOWNLOAD}.")
    return tokenizer
