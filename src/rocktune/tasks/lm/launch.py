"""What the launching process refuses and checks for a task on a causal LM (lm, dpo, orpo) before the supervisor,
torchrun or any worker starts: torch-free. The workers decide the refusals again (``task.refuse``, resume's checks):
a request may come from elsewhere."""

from __future__ import annotations

from pathlib import Path

from rocktune.config import RunConfig, refuse_inapplicable
from rocktune.data.records import read_records
from rocktune.train.prelaunch import refuse_layout
from rocktune.train.request import RunOptions

# Larger files are read once, by the worker: parsing them twice would cost more than the early answer saves.
PRECHECK_MAX_BYTES = 64 << 20


def refuse(cfg: RunConfig, options: RunOptions) -> None:
    from rocktune.train.resume import check_world_before_launch

    refuse_inapplicable(cfg)
    refuse_layout(options.processes, cfg.training.parallel, cfg.model.quantization)
    if options.resume:  # LM checkpoints record how many processes wrote them
        check_world_before_launch(Path(cfg.output.dir) / "checkpoints", options.processes, options.resume_force)


def precheck(cfg: RunConfig) -> None:
    """The JSON of data files small enough to read twice: every malformed line at once, as the worker would say it,
    within a second instead of after the child has loaded torch and the tokenizer."""
    for file in (cfg.data.train_file, cfg.data.eval_file):
        path = Path(file) if file else None
        if path is not None and path.is_file() and path.suffix.lower() in (".json", ".jsonl") \
                and path.stat().st_size <= PRECHECK_MAX_BYTES:  # the other kinds are read by datasets
            read_records(path)
