"""The llama.cpp command an export prints after ``then:``, built from the files it wrote: what a user copies must run
the trained model (the merged file, or the base with ``--lora``), with a vision run's mmproj and the image-token
limits its processor trained with (``gguf_vision.ImageTokens``: llama.cpp reads them from no file for Qwen)."""

from __future__ import annotations

import shlex
from pathlib import Path

from rocktune.tasks.vlm.export.gguf_vision import ImageTokens

# what the command leaves to the user: the picture and the question (llama-mtmd-cli), the prompt (llama-cli)
PHOTO = "PHOTO.png"
PROMPT = "..."


def llama_argv(model: Path | str, lora: Path | str | None = None, mmproj: Path | str | None = None,
               tokens: ImageTokens | None = None) -> list[str]:
    """``llama-mtmd-cli`` (with an mmproj) or ``llama-cli`` on ``model``, the LoRA applied where there is one."""
    argv = ["llama-mtmd-cli" if mmproj else "llama-cli", "-m", str(model)]
    if lora:
        argv += ["--lora", str(lora)]
    if mmproj:
        argv += ["--mmproj", str(mmproj), *(tokens.flags() if tokens else []), "--image", PHOTO]
    return argv + ["-p", PROMPT]


def then(argv: list[str]) -> str:
    """The note's text: the command, shell-quoted, and the server that takes the same model flags."""
    server = "-m, --lora, --mmproj and --image-* flags" if "--mmproj" in argv else "-m and --lora flags"
    return f"then: {shlex.join(argv)} (or llama-server with the same {server})"


def parse_then(line: str) -> list[str]:
    """The argv of a line :func:`then` wrote (the part before the server's remark), as a shell would split it."""
    command = line.removeprefix("note: ").removeprefix("then: ")
    return shlex.split(command.split(" (or llama-server")[0])
