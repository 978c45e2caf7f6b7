"""What the launching process refuses and checks for a task on a causal LM (lm, dpo, orpo) before the supervisor,
torchrun or any worker starts: torch-free. The workers decide the refusals again (``task.refuse``, resume's checks):
a request may come from elsewhere."""

from __future__ import annotations

from pathlib import Path

from rocktune.config import RunConfig, refuse_inapplicable
from rocktune.data.records import read_records, scan_jsonl
from rocktune.train.prelaunch import refuse_layout
from rocktune.train.request import RunOptions

# Files up to this size are read whole (as the worker reads them); a larger JSONL file is streamed line by line
# (records.scan_jsonl: memory bounded by its longest line). A larger JSON array is left to the worker: an array
# cannot be parsed a record at a time by the standard library's parser.
PRECHECK_MAX_BYTES = 64 << 20


def refuse(cfg: RunConfig, options: RunOptions) -> None:
    from rocktune.train.resume import check_world_before_launch

    refuse_inapplicable(cfg)
    refuse_layout(options.processes, cfg.training.parallel, cfg.model.quantization)
    if options.resume:  # LM checkpoints record how many processes wrote them
        check_world_before_launch(Path(cfg.output.dir) / "checkpoints", options.processes, options.resume_force)


def precheck(cfg: RunConfig) -> None:
    """The JSON of the data files: every malformed line at once, as the worker would say it, before the child has
    loaded torch and the tokenizer (for a large file, before minutes of tokenising)."""
    for file in (cfg.data.train_file, cfg.data.eval_file):
        path = Path(file) if file else None
        if path is None or not path.is_file() or path.suffix.lower() not in (".json", ".jsonl"):
            continue  # the other kinds are read by datasets
        if path.stat().st_size <= PRECHECK_MAX_BYTES:
            read_records(path)
        elif path.suffix != ".json" and not _starts_array(path):  # read_records' own test of JSONL
            scan_jsonl(path)


def _starts_array(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4096).lstrip().startswith(b"[")
