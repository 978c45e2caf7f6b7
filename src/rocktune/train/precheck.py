"""What ``rocktune train`` can refuse within a second, in the command's own process, before a child imports torch
and loads a tokenizer (which took half a minute before a malformed line or a clobbered run directory was named).

Only what needs no model: the run directory (unless ``--auto``, whose fitted config is what it compares) and the
JSON of LM data files small enough to read twice. The worker checks all of it again, in the same words.
"""

from __future__ import annotations

from pathlib import Path

from rocktune.config import RunConfig
from rocktune.data.records import read_records
from rocktune.train.request import RunOptions
from rocktune.train.rundir import check_output_dir

# Larger files are read once, by the worker: parsing them twice would cost more than the early answer saves.
PRECHECK_MAX_BYTES = 64 << 20


def check_before_start(cfg: RunConfig, options: RunOptions) -> None:
    if not options.auto_fit:
        check_output_dir(Path(cfg.output.dir), cfg.model_dump(mode="json"), options.overwrite, options.resume)
    if cfg.is_diffusion:
        return  # media folders and manifests are checked by the Wan task, clip by clip
    for file in (cfg.data.train_file, cfg.data.eval_file):
        path = Path(file) if file else None
        if path is not None and path.is_file() and path.suffix.lower() in (".json", ".jsonl") \
                and path.stat().st_size <= PRECHECK_MAX_BYTES:  # the other kinds are read by datasets
            read_records(path)  # every malformed line at once, as the worker would say it
