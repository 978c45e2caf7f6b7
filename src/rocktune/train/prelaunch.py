"""Refusals the launching process decides before a worker, torchrun or a file exists: they depend on the config,
the number of processes and the run directory's checkpoint records alone. Torch-free on purpose: the supervisor
that runs them lives for the whole run and never imports torch. The workers decide the same again."""

from __future__ import annotations

from pathlib import Path

from rocktune.errors import UserError
from rocktune.readers.json_file import JsonProblem, parse_json


def refuse_layout(processes: int, parallel: str, quantization: str) -> None:
    """``training.parallel`` against ``model.quantization`` for ``processes`` ranks (distributed.strategy too)."""
    if processes > 1 and parallel == "fsdp" and quantization != "none":
        raise UserError("training.parallel=fsdp with model.quantization: FSDP does not shard bitsandbytes' packed "
                        "weights. A quantised base is small: use training.parallel=ddp.")


def saved_world(ckpt_root: Path) -> tuple[str, int] | None:
    """(checkpoint name, number of processes that wrote it) of the newest checkpoint whose meta.json reads; no
    hashes checked (restore does that): a run changes its number of processes only with --resume-force, so an
    older checkpoint restore might fall back to records the same number."""
    if not ckpt_root.is_dir():
        return None
    found = sorted((p for p in ckpt_root.glob("step-*") if p.is_dir() and p.name[5:].isdigit()),
                   key=lambda p: int(p.name[5:]), reverse=True)
    for path in found:
        try:
            extra = parse_json((path / "meta.json").read_bytes()).get("extra")
        except (OSError, JsonProblem, AttributeError):
            continue
        world = extra.get("world_size", 1) if isinstance(extra, dict) else 1
        return path.name, world
    return None
