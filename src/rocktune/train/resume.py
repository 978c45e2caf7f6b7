"""Resume safety: refuse to continue a run whose config or data changed in a way that would make it wrong."""

from __future__ import annotations

from pathlib import Path


from rocktune.errors import UserError
from rocktune.atomic import kill_point, leftovers, write_atomic
from rocktune.readers import metrics_log
from rocktune.readers.json_file import JsonProblem, parse_json
from rocktune.train.rundir import CONFIG_NAME, DAMAGED_CONFIG, diff_keys
from rocktune.readers.yaml_file import read_yaml

# Keys that may change between a run and its resume without changing what the resumed steps compute. The length
# of the run is not among them: it shapes the learning-rate schedule, so extending a run needs --resume-force.
# The token budget and compilation only change how a step's samples are cut into forwards (another GPU may fit
# another budget), not which samples a step holds.
RESUMABLE_CHANGES = ("training.eval_every", "training.log_every", "reliability.", "output.dir",
                     "training.micro_batch_tokens", "training.compile")

# Keys whose default changed: a run whose saved config lacks one was trained with the earlier behaviour, which its
# resume keeps so that the resumed steps are the ones the run would have taken. key: (new default, the earlier one)
CHANGED_DEFAULTS = {"data.batch_order": ("mixed", "length")}


def keep_earlier_defaults(run_dir: Path, cfg) -> list[str]:
    """Set on ``cfg`` (a RunConfig) the earlier behaviour of each changed default that the run's saved config
    predates and that ``cfg`` leaves at its new default; the notes say so."""
    saved = run_dir / CONFIG_NAME
    if not saved.is_file():
        return []
    old = read_yaml(saved, DAMAGED_CONFIG)[0] or {}
    notes = []
    for key, (new, earlier) in CHANGED_DEFAULTS.items():
        section, field = key.split(".")
        if _lookup(old, section) is _ABSENT or _lookup(old, key) is not _ABSENT:
            continue
        if getattr(getattr(cfg, section), field) == new:
            setattr(getattr(cfg, section), field, earlier)
            notes.append(f"{key}: {earlier}, as this run was trained (it predates the key; the default is now {new})")
    return notes


def check_config(run_dir: Path, config: dict, force: bool) -> None:
    saved = run_dir / CONFIG_NAME
    if not saved.is_file():
        return  # killed before it wrote anything: the resume is simply the start of the run
    old = read_yaml(saved, DAMAGED_CONFIG)[0] or {}
    changed = [k for k in diff_keys(old, config)
               if not k.startswith(RESUMABLE_CHANGES) and not _new_key_at_default(old, config, k)]
    if changed and not force:
        raise UserError(f"--resume: the config differs from the run in {run_dir} in {', '.join(changed[:8])}; "
                        "resuming would mix two different runs. Restore those values, or pass --resume-force to "
                        "continue anyway.")


def _lookup(tree: dict, key: str):
    for part in key.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return _ABSENT
        tree = tree[part]
    return tree


_ABSENT = object()


def _new_key_at_default(old: dict, config: dict, key: str) -> bool:
    """A key the run's saved config lacks (a newer rocktune added it) left at its default computes what the version
    that wrote the run computed: it is no change, so an upgrade between a kill and its resume does not refuse."""
    if _lookup(old, key) is not _ABSENT:
        return False
    if key in CHANGED_DEFAULTS:  # what the run was trained with is the earlier default, not the current one
        return CHANGED_DEFAULTS[key][1] == _lookup(config, key)
    default = _default(key)
    return default is not _ABSENT and default == _lookup(config, key)


def _default(key: str):
    """The documented default of a dotted config key (config.py's fields), or _ABSENT for a key it does not have."""
    from pydantic import BaseModel

    from rocktune.config import RunConfig

    cls: type[BaseModel]
    cls, *_, last = (RunConfig, *key.split("."))
    for part in key.split(".")[:-1]:
        field = cls.model_fields.get(part)
        if field is None or not (isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)):
            return _ABSENT
        cls = field.annotation
    field = cls.model_fields.get(last)
    return _ABSENT if field is None else field.get_default(call_default_factory=True)


def check_data(restored, fingerprint: str, force: bool) -> None:
    if restored is None:
        return
    old = restored.extra.get("data_fingerprint")
    if old != fingerprint and not force:
        raise UserError("--resume: the training data (or tokenizer, template, max length) changed since checkpoint "
                        f"{restored.path.name} was written, so the saved data position no longer means the same "
                        "examples. Restore the data, or pass --resume-force to continue anyway.")


def check_batching(restored, mode: str) -> None:
    """A step's data position means micro-batches with batching=examples and whole steps with batching=tokens;
    ``batching: auto`` resolves by device, so a run moved between a GPU and a CPU must name the mode it used."""
    if restored is None:
        return
    saved = restored.extra.get("batching", "examples")
    if saved != mode:
        raise UserError(f"--resume: checkpoint {restored.path.name} was written with batching={saved}, but this "
                        f"machine resolves training.batching to {mode}; the saved data position only means the same "
                        f"examples in the same mode. Resume with training.batching={saved}.")


def check_world(restored, world: int, force: bool) -> None:
    """Each rank's data share and RNG state belong to the number of ranks the run was written with."""
    if restored is None:
        return
    _check_world(restored.path.name, restored.extra.get("world_size", 1), world, force)


def check_world_before_launch(ckpt_root: Path, world: int, force: bool) -> None:
    """``check_world`` in the launching process, from the newest checkpoint's meta.json: one paragraph before
    torchrun starts, instead of one per rank after the model loaded."""
    from rocktune.train.prelaunch import saved_world

    found = saved_world(ckpt_root)
    if found is not None:
        _check_world(*found, world, force)


def _check_world(name: str, saved, world: int, force: bool) -> None:
    if saved != world and not force:
        raise UserError(f"--resume: checkpoint {name} was written by {saved} process(es), this launch "
                        f"has {world}; the same global batch would be split differently, so the result would no "
                        f"longer be one exact run. Resume with --nproc {saved}, or pass --resume-force.")


def truncate_metrics(path: Path, keep_lines: int) -> list[str]:
    """Cut the log back to the ``keep_lines`` lines written before the checkpoint, so a resumed run's log equals an
    uninterrupted one; returns what else it dropped, for the console. The one writer is this process (runlock.py),
    so the count is the file's. The cut is one atomic replace (a kill before it leaves the file as it was; one
    after, cut; its temporary of a killed attempt is removed here). Also dropped: a last line without its newline
    (cut short), which the next line would otherwise extend into one garbled line, and repeated lines, which only
    a log written by an older version holds (two processes appending at once)."""
    for stale in leftovers(path):
        stale.unlink(missing_ok=True)
    if not path.is_file():
        return []
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    kept, notes = lines[:keep_lines], []
    if len(lines) < keep_lines:  # the log was not synced before a checkpoint until this version: a power cut
        notes.append(f"{path.name} holds {len(lines)} lines, fewer than the {keep_lines} its checkpoint counts (lost "
                     "in a power cut?): the steps they logged stay missing from it")
    if kept and not kept[-1].endswith("\n"):
        kept.pop()
        notes.append(f"{path.name}: dropped its last line, cut short")
    kept, dropped = _drop_repeats(kept)
    if dropped:
        notes.append(f"{path.name}: dropped repeated lines of {dropped} (logged twice by an earlier version; the "
                     "later copy kept)")
    kill_point("metrics.truncating")
    if len(kept) != len(lines):
        write_atomic(path, "".join(kept))
    kill_point("metrics.truncated")
    return notes


def _drop_repeats(lines: list[str]) -> tuple[list[str], str | None]:
    """``lines`` but those a later line logs again (readers/metrics_log.py), and the dropped ones described."""
    parsed = []
    for line in lines:
        try:
            parsed.append(parse_json(line))
        except JsonProblem:
            parsed.append(None)  # left for the report to name; never a repeat
    again = metrics_log.repeats(parsed)
    if not again:
        return lines, None
    return ([line for i, line in enumerate(lines) if i not in again],
            metrics_log.describe([parsed[i].get("step") for i in sorted(again)]))
