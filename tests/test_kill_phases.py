"""Kills aimed at every phase of a write (atomic.PHASES), for every task in the registry: the process SIGKILLs
itself exactly between two steps of a checkpoint save, of the final adapter/LoRA writes or of an export; then what
is on disk is checked (nothing half-written is where a reader looks) and the run is resumed (the export rerun):
the result must equal the uninterrupted reference byte for byte. The references are shared with
tests/test_task_contract.py (one uninterrupted run per task). The full matrix is marked long (`make test-long`,
CI); a subset runs in `make test`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from rocktune.atomic import PHASES
from rocktune.config import config_from_dict
from rocktune.task_registry import TASKS
from rocktune.tasks import train
from rocktune.train import checkpoint
from rocktune.train.request import RunOptions, RunRequest
from tests import test_task_contract as contract
from tests.test_task_contract import assert_same_run, run_worker

kind = contract.kind  # the contract tests' fixture: one Kind, and one uninterrupted reference run, per task

# (phase, n): the n-th time a run of test_task_contract's configs (8 steps, a checkpoint every 2, keep 2) reaches it
RUN_KILLS = [
    ("atomic.written", 1),  # the run's copy of its config
    ("atomic.fsynced", 4),  # `latest` of the step-4 checkpoint (config, run_info.json, step 2's latest before it)
    ("checkpoint.adapter_written", 2), ("checkpoint.state_written", 2), ("checkpoint.before_manifest", 2),
    ("checkpoint.before_fsync", 2), ("checkpoint.after_fsync", 2), ("checkpoint.before_rename", 2),
    ("checkpoint.renamed", 2),
    ("checkpoint.pruning", 1),  # step 6's save deletes step 2
    ("adapter.weights_written", 1), ("adapter.staged", 1), ("adapter.swapped", 1),
    # the metric log's own writes: its 5th line (the 4th step's for lm; around step 3-4 for the others, whose evals
    # add lines), before it is appended and after it is appended and flushed, with no checkpoint yet for it
    ("metrics.appending", 5), ("metrics.appended", 5),
    ("finish.evaluated", 1), ("finish.logged", 1),  # around the final eval: before its line, after it and samples
]
# Killed in the resume after a first kill: before and after the truncation of the log to the checkpoint's count.
TRUNCATION_KILLS = ["metrics.truncating", "metrics.truncated"]
FIRST_KILL = ("metrics.appended", 5)  # leaves lines after the newest checkpoint, so the resume has lines to cut
# Fields of a metrics line that legitimately differ between two runs of the same steps: wall-clock time and memory
# measured as the process ran (step_s, throughput, the wait for the device; RSS and device memory, which depend on
# what else the process did: a resumed process never ran the steps before its checkpoint), and whether the step
# compiled (the first step of every attempt does, when compiling). Every other field must be equal, line by line.
VOLATILE = {"step_s", "useful_tokens_per_s", "device_wait_s", "rss_bytes", "peak_rss_bytes", "peak_mem_bytes",
            "mem_allocated_bytes", "mem_reserved_bytes", "compiling", "compile_fallback",
            "rollout_s", "rollout_tokens_per_s"}  # GRPO's rollout: wall-clock time too
WAN_ONLY = [("lora_file.written", 1)]
# 7-9 s a kill when the machine is idle (a kill at finish.logged runs by default in tests/test_run_lock.py, with
# TensorBoard on); the rest is long
FAST = {("lm", "checkpoint.pruning"), ("lm", "metrics.appended"), ("lm", "metrics.truncating"),
        ("grpo", "checkpoint.state_written")}
TASKS_KILLED = ("lm", "dpo", "orpo", "wan", "grpo", "vlm")
# The steps inside one atomic write (write, fsync, manifest, rename, prune) are one code path whatever the task saves:
# `make test-long` kills them in the LM run only, and kills every task where what is on disk depends on the task —
# its state written, a complete checkpoint, its adapter, its log lines, its final phase (and the resume's cut, below).
# ROCKTUNE_KILL_MATRIX=full kills every phase in every task (about 115 kills: CI's time allows 64).
PER_TASK = {"checkpoint.state_written", "checkpoint.renamed", "adapter.staged", "metrics.appending",
            "metrics.appended", "finish.evaluated", "finish.logged", "lora_file.written"}
FULL = os.environ.get("ROCKTUNE_KILL_MATRIX") == "full"


def _cases():
    for task in TASKS_KILLED:
        for phase, n in RUN_KILLS + (WAN_ONLY if task == "wan" else []):
            if not (FULL or task == "lm" or phase in PER_TASK):
                continue
            marks = () if (task, phase) in FAST else (pytest.mark.long,)
            yield pytest.param(task, phase, n, id=f"{task}-{phase}:{n}", marks=marks)


def test_every_phase_is_in_a_matrix():
    """A phase added to atomic.PHASES must be killed somewhere here (adapter.old_moved needs an earlier adapter)."""
    covered = {p for p, _ in RUN_KILLS + WAN_ONLY} | set(EXPORT_PHASES) | set(TRUNCATION_KILLS) | {"adapter.old_moved"}
    assert covered == set(PHASES)
    # every task object of the registry is killed (image-lora is the WanTask of video-lora, tested as "wan")
    kinds = {"lm": "lm", "dpo": "dpo", "orpo": "orpo", "wan": "video-lora", "grpo": "grpo", "vlm": "vlm"}
    assert {TASKS[kinds[k]].builder for k in TASKS_KILLED} == {spec.builder for spec in TASKS.values()}


@pytest.mark.parametrize("kind, phase, n", list(_cases()), indirect=["kind"])
def test_kill_at_a_write_phase_then_resume_is_exact(kind, phase, n, tmp_path_factory, tmp_path):
    ref = kind.ref(tmp_path_factory)
    run = tmp_path / "run"
    cfg = kind.config(run)
    proc = run_worker(cfg, {"kill_at": f"{phase}:{n}"})
    assert proc.returncode == -signal.SIGKILL, f"{phase}:{n} was never reached\n{proc.stderr[-2000:]}"
    _nothing_half_written_where_read(run)
    _log_in_step_with_the_checkpoint(run, ref)
    result = train(config_from_dict(cfg), RunOptions(resume=True), quiet=True)
    assert not result.interrupted
    _assert_finished_like_the_reference(kind, run, ref)


@pytest.mark.parametrize("kind, phase", [
    pytest.param(task, phase, id=f"{task}-{phase}", marks=() if (task, phase) in FAST else (pytest.mark.long,))
    for task in TASKS_KILLED for phase in TRUNCATION_KILLS], indirect=["kind"])
def test_kill_at_the_resume_truncation_then_resume_is_exact(kind, phase, tmp_path_factory, tmp_path):
    """Killed after a line the newest checkpoint does not count; the resume killed before, or right after, it cuts
    the log back to the checkpoint's count; the next resume finishes equal to the reference, line by line."""
    ref = kind.ref(tmp_path_factory)
    run = tmp_path / "run"
    cfg = kind.config(run)
    assert run_worker(cfg, {"kill_at": "%s:%d" % FIRST_KILL}).returncode == -signal.SIGKILL
    lines = (run / "metrics.jsonl").read_text()
    resumed = run_worker_resume(cfg, {"kill_at": phase})
    assert resumed.returncode == -signal.SIGKILL, f"{phase} was never reached\n{resumed.stderr[-2000:]}"
    after = (run / "metrics.jsonl").read_text()
    assert after == lines if phase == "metrics.truncating" else lines.startswith(after) and after != lines
    _log_in_step_with_the_checkpoint(run, ref)
    result = train(config_from_dict(cfg), RunOptions(resume=True), quiet=True)
    assert not result.interrupted
    _assert_finished_like_the_reference(kind, run, ref)


def run_worker_resume(cfg: dict, faults: dict) -> subprocess.CompletedProcess:
    request = RunRequest(cfg, RunOptions(resume=True))
    env = dict(os.environ, ROCKTUNE_FAULTS=json.dumps(faults))
    return subprocess.run([sys.executable, "-m", "rocktune.process.worker", request.to_json()], env=env,
                          capture_output=True, text=True)


def _assert_finished_like_the_reference(kind, run: Path, ref: Path) -> None:
    assert_same_run(kind, run, ref)
    assert_same_log(run, ref)
    assert not list(run.glob(".metrics.jsonl.*")), "a truncation's temporary was left behind"
    ckpts = run / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir() if p.name != checkpoint.LATEST) == ["step-0000006",
                                                                                       "step-0000008"]
    assert (ckpts / checkpoint.LATEST).read_text() == "step-0000008\n"
    assert not list(run.glob("adapter.*")), "the final adapter's temporary or previous copy was left behind"


def _lines(path: Path) -> list[dict]:
    """The log's lines, each without its volatile values but with the names of all its fields."""
    return [{k: v for k, v in rec.items() if k not in VOLATILE} | {"fields": sorted(rec)}
            for rec in map(json.loads, path.read_text().splitlines())] if path.is_file() else []


def assert_same_log(run: Path, ref: Path) -> None:
    """The whole metrics log, line by line: the same lines in the same order, every field but VOLATILE equal."""
    got, want = _lines(run / "metrics.jsonl"), _lines(ref / "metrics.jsonl")
    assert len(got) == len(want), f"{len(got)} lines against the reference's {len(want)}: {[r['step'] for r in got]}"
    for n, (a, b) in enumerate(zip(got, want), start=1):
        assert a == b, f"metrics.jsonl line {n} differs"


def _log_in_step_with_the_checkpoint(run: Path, ref: Path) -> None:
    """Right after a kill: the checkpoint a resume would pick counts no more lines than the file holds whole, and
    those lines are the reference's first ones (so the resume's cut leaves exactly the uninterrupted prefix)."""
    newest = next((p for p in sorted(run.glob("checkpoints/step-*"), reverse=True)
                   if checkpoint.verify(p) is None), None)
    if newest is None:
        return  # no checkpoint: the resume starts over
    count = json.loads((newest / "meta.json").read_text())["extra"]["metrics_lines"]
    text = (run / "metrics.jsonl").read_text()
    whole = text.count("\n")
    assert count <= whole, f"{newest.name} counts {count} lines, the file holds {whole} whole ones"
    got = [{k: v for k, v in json.loads(x).items() if k not in VOLATILE} for x in text.splitlines()[:count]]
    want = [{k: v for k, v in r.items() if k != "fields"} for r in _lines(ref / "metrics.jsonl")[:count]]
    assert got == want


def _nothing_half_written_where_read(run: Path) -> None:
    """Right after the kill: every checkpoint a resume could pick verifies (a half-pruned one has no manifest and is
    never a candidate), `latest` names a whole one, and adapter/ (if there) holds complete, loadable files."""
    ckpts = run / "checkpoints"
    for path in ckpts.glob("step-*"):
        problem = checkpoint.verify(path)
        assert problem is None or not (path / checkpoint.MANIFEST).exists(), f"{path.name}: {problem}"
    if (ckpts / checkpoint.LATEST).exists():
        named = ckpts / (ckpts / checkpoint.LATEST).read_text().strip()
        assert checkpoint.verify(named) is None, named
    adapter = run / "adapter"
    if adapter.exists():
        from safetensors.torch import load_file

        assert json.loads((adapter / "adapter_config.json").read_text())["r"] > 0
        assert load_file(adapter / "adapter_model.safetensors")


# The export's phases, killed while `rocktune export RUN --to merged --overwrite` replaces an earlier export.
EXPORT_PHASES = ["export.written", "export.fsynced", "export.old_moved", "export.swapped"]


@pytest.fixture(scope="module")
def merged_reference(request, tmp_path_factory) -> tuple[Path, Path]:
    """The LM reference run and its merged export, written by an uninterrupted `rocktune export`."""
    from rocktune.cli import main

    lm = request.getfixturevalue("reference")
    out = tmp_path_factory.mktemp("export-ref") / "merged"
    assert main(["export", str(lm), "--to", "merged", "--out", str(out)]) == 0
    return lm, out


@pytest.mark.parametrize("phase", [p if p == "export.old_moved" else pytest.param(p, marks=pytest.mark.long)
                                   for p in EXPORT_PHASES])
def test_kill_at_an_export_phase_keeps_old_or_new_and_the_rerun_is_exact(merged_reference, phase, tmp_path):
    run, want = merged_reference
    target = tmp_path / "merged"
    target.mkdir()
    (target / "config.json").write_text('{"earlier": "export"}')  # an earlier export that --overwrite replaces
    cmd = [sys.executable, "-m", "rocktune", "export", str(run), "--to", "merged", "--out", str(target),
           "--overwrite"]
    env = dict(os.environ, ROCKTUNE_FAULTS=json.dumps({"kill_at": phase}))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL, f"{phase} was never reached\n{proc.stderr[-2000:]}"
    from rocktune.export.output import check_target

    check_target(target, overwrite=True, is_dir=True)  # what the next export does first: puts back a moved one
    assert _tree(target) in (_tree(want), {"config.json": b'{"earlier": "export"}'}), "half an export at the target"
    assert subprocess.run(cmd, capture_output=True, text=True).returncode == 0
    assert _tree(target) == _tree(want)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["merged"], "the export left a partial or old copy"


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_adapter_kill_between_the_two_renames_leaves_a_run_that_resumes(tmp_path):
    """adapter.old_moved: only reached when an adapter/ already exists (a finish redone); killed there, adapter/ is
    absent, so the run is not taken for complete, and the next save_adapter clears adapter.old."""
    script = (
        "import sys\n"
        "from pathlib import Path\n"
        "from rocktune.train.finish import save_adapter\n"
        "class M:\n"
        "    def save_pretrained(self, d, safe_serialization):\n"
        "        Path(d).mkdir(parents=True); (Path(d) / 'adapter_config.json').write_text(sys.argv[2])\n"
        "root = Path(sys.argv[1]); (root / 'config.yaml').write_text('task: lm\\n')\n"
        "save_adapter(M(), root / 'adapter', root / 'config.yaml')\n"
    )
    first = subprocess.run([sys.executable, "-c", script, str(tmp_path), "old"], capture_output=True, text=True)
    assert first.returncode == 0, first.stderr[-2000:]
    env = dict(os.environ, ROCKTUNE_FAULTS=json.dumps({"kill_at": "adapter.old_moved"}))
    killed = subprocess.run([sys.executable, "-c", script, str(tmp_path), "new"], env=env, capture_output=True,
                            text=True)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert not (tmp_path / "adapter").exists() and (tmp_path / "adapter.old" / "adapter_config.json").is_file()
    from rocktune.train.summary import already_complete

    assert not already_complete(tmp_path, force=False)  # so --resume redoes the finish
    again = subprocess.run([sys.executable, "-c", script, str(tmp_path), "new"], capture_output=True, text=True)
    assert again.returncode == 0, again.stderr[-2000:]
    assert (tmp_path / "adapter" / "adapter_config.json").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter", "config.yaml"]


def test_a_kill_point_is_exact_and_an_unknown_phase_is_refused(tmp_path):
    """write_atomic killed after its fsync: the target keeps its old bytes. A misspelt phase fails loudly instead of
    a test passing because its kill never fired."""
    target = tmp_path / "f.txt"
    target.write_text("old")
    code = f"from rocktune.atomic import write_atomic\nwrite_atomic({str(target)!r}, 'new')\n"
    env = dict(os.environ, ROCKTUNE_FAULTS=json.dumps({"kill_at": "atomic.fsynced"}))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL and target.read_text() == "old"
    env["ROCKTUNE_FAULTS"] = json.dumps({"kill_at": "atomic.fsync"})
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert proc.returncode == 1 and "expected PHASE[:N]" in proc.stderr and target.read_text() == "old"
