"""Out of memory on any device takes one path (issue 39): a CPU allocation refused under a real address-space limit
splits the step like a GPU OOM, then stops with one paragraph (exit 7) naming memory, the bytes asked for and the
planner's suggestion; a worker the kernel's OOM killer ends is named as such, restarted only smaller, and not
looped. The limits are real, set in child processes; the cgroup test runs where the machine lets us make one."""

from __future__ import annotations

import errno
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from rocktune import exits
from rocktune.process import oomkill
from rocktune.train.oom import is_out_of_memory
from rocktune.train.request import RunOptions, RunRequest
from tests.conftest import tiny_run_config, write_jsonl

ROOT = Path(__file__).parent.parent
LINUX = sys.platform.startswith("linux")


@pytest.fixture(scope="module")
def long_rows(tmp_path_factory) -> tuple[Path, Path]:
    """Rows long enough (~128 tokens) that one example's forward needs more than the 1 MiB left to it."""
    rows = [{"prompt": "copy " + "abcd " * (18 + i % 4), "completion": " abcd"} for i in range(16)]
    tmp = tmp_path_factory.mktemp("oom")
    return write_jsonl(tmp / "train.jsonl", rows), write_jsonl(tmp / "eval.jsonl", rows[:2])


def test_allocator_failures_of_every_device_count_as_out_of_memory():
    from rocktune.train.oom import DEVICE_OOM

    assert is_out_of_memory(DEVICE_OOM("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert is_out_of_memory(MemoryError())
    assert is_out_of_memory(RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't "
                                         "allocate memory: you tried to allocate 196608 bytes."))
    assert is_out_of_memory(RuntimeError("HIP error: out of memory"))
    assert not is_out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_out_of_memory(OSError(errno.ENOMEM, "Cannot allocate memory"))  # fork/mmap by hand: not a step's


@pytest.mark.skipif(not LINUX, reason="RLIMIT_AS and /proc/self/status are Linux's")
def test_cpu_allocation_refused_by_rlimit_as_splits_then_stops_naming_memory(tiny_model_dir, long_rows, tmp_path):
    cfg = tiny_run_config(tiny_model_dir, *long_rows, tmp_path / "run", max_steps=3, micro_batch_size=8,
                          grad_accum=1)
    cfg["data"]["max_length"] = 128
    request = RunRequest(cfg, RunOptions(overwrite=True))
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536",  # large blocks are mapped and unmapped, never kept
               PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "oom_child.py"), request.to_json(), "1"], env=env,
                          capture_output=True, text=True, timeout=300)
    err = proc.stderr
    assert proc.returncode == exits.OUT_OF_MEMORY, err[-3000:]
    assert "split in 2" in err and "split in 8" in err  # the same path as a GPU OOM: smaller forwards first
    # After the splits the stop names memory, what was asked and what fits. Under a machine's load the allocator can
    # also refuse the next allocation outside the step (the stop's own work): that is named as memory too, exit 7.
    stopped = re.search(r"out of memory at step [23] even with one example per forward", err)
    assert stopped or "out of memory outside a training step" in err, err[-3000:]
    assert "rocktune plan" in err and (not stopped or "you tried to allocate" in err)
    assert "Traceback" not in err
    assert (tmp_path / "run" / "checkpoints").is_dir() or (tmp_path / "run" / "metrics.jsonl").is_file()


def test_oom_watch_reads_the_cgroup_counter_and_the_limit(tmp_path):
    proc, root = tmp_path / "proc", tmp_path / "cg"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text("0::/job\n")
    (proc / "meminfo").write_text("MemTotal:       4000 kB\n")
    (root / "job").mkdir(parents=True)
    events = root / "job" / "memory.events"
    events.write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n")
    (root / "job" / "memory.max").write_text(f"{512 * 2**20}\n")
    watch = oomkill.OomWatch(root, proc)
    assert watch.cgroup == root / "job" and oomkill.memory_limit(watch.cgroup, proc) == 512 * 2**20
    assert watch.verdict(-signal.SIGKILL, peak_rss=0) is None  # a plain kill -9
    events.write_text("low 0\nhigh 0\nmax 9\noom 2\noom_kill 2\n")
    said = watch.verdict(-signal.SIGKILL, peak_rss=0)
    assert said and "out-of-memory killer" in said and "1 -> 2" in said
    assert watch.verdict(1) is None  # only a SIGKILL can be the OOM killer's
    (root / "job" / "memory.max").write_text("max\n")  # no cgroup limit: the machine's memory is the limit
    events.write_text("oom_kill 2\n")
    assert "at the limit" in oomkill.OomWatch(root, proc).verdict(-signal.SIGKILL, peak_rss=3900 * 1024)


@pytest.mark.long
@pytest.mark.slow  # two real worker start-ups (~20 s each on 2 busy cores)
def test_oom_killed_worker_restarts_smaller_once_then_stops_with_exit_7(tiny_model_dir, data, tmp_path, monkeypatch):
    """The real supervisor and worker; the worker dies by SIGKILL at step 5 every time, and the kernel's verdict is
    given (no machine lets a test call in the OOM killer safely). Restarted with its forwards split, it dies at the
    same step again: the run stops with exit 7 instead of restarting in a loop."""
    import json

    from rocktune.config import config_from_dict
    from rocktune.process.supervisor import supervise
    from tests.lm_runs import config

    monkeypatch.setattr(oomkill.OomWatch, "verdict", lambda self, code, peak_rss=None:
                        "killed by the kernel's out-of-memory killer (test)" if code == -signal.SIGKILL else None)
    monkeypatch.setenv("ROCKTUNE_FAULTS", json.dumps({"kill_at_step": 5}))
    cfg = config(tiny_model_dir, data, tmp_path / "run")
    cfg = config_from_dict(cfg).model_dump(mode="json")
    code = supervise(RunRequest(cfg, RunOptions(overwrite=True)), max_restarts=5)
    assert code == exits.OUT_OF_MEMORY
    incidents = [json.loads(x) for x in (tmp_path / "run" / "incidents.jsonl").read_text().splitlines()]
    assert [i["restart"] for i in incidents] == [1, None]  # one smaller restart, not five
    assert all("out-of-memory killer" in i["cause"] for i in incidents)
    assert [i["last_logged_step"] for i in incidents] == [4, 4]
    assert not list((tmp_path / "run").glob("adapter"))  # nothing claims the run finished


def _own_cgroup_v2() -> tuple[Path | None, str]:
    if not LINUX:
        return None, "cgroups are Linux's"
    here = oomkill.cgroup_dir()
    if here is None or not (here / "memory.events").is_file():
        return None, f"no cgroup v2 memory controller for this process (found {here})"
    if "memory" not in (here / "cgroup.controllers").read_text().split():
        return None, f"the memory controller is not delegated to {here}"
    if not os.access(here, os.W_OK):
        return None, f"{here} is not writable: no child cgroup can be made here"
    return here, ""


@pytest.mark.skipif(not _own_cgroup_v2()[0], reason=_own_cgroup_v2()[1] or "no cgroup")
def test_cgroup_memory_max_oom_kill_is_named_and_not_looped(tiny_model_dir, data, tmp_path):
    import yaml

    from tests.lm_runs import config

    here, _ = _own_cgroup_v2()
    group = here / f"rocktune-oom-test-{os.getpid()}"
    try:
        group.mkdir()
        (group / "memory.max").write_text(str(200 * 2**20))  # below what torch alone maps: killed in start-up
        if (group / "memory.swap.max").exists():
            (group / "memory.swap.max").write_text("0")
    except OSError as exc:
        pytest.skip(f"cannot make a memory-limited cgroup under {here}: {exc}")
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text(yaml.safe_dump(config(tiny_model_dir, data, tmp_path / "run")))
    procs = group / "cgroup.procs"
    try:
        proc = subprocess.run([sys.executable, "-m", "rocktune", "train", "-c", str(cfg_file)], capture_output=True,
                              text=True, timeout=300, preexec_fn=lambda: procs.write_text(str(os.getpid())))
    finally:
        group.rmdir()
    assert proc.returncode == exits.OUT_OF_MEMORY, proc.stderr[-3000:]
    assert "out-of-memory killer" in proc.stderr and "would loop" in proc.stderr


@pytest.mark.parametrize("exc", [MemoryError(), RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. "
                                                             "DefaultCPUAllocator: can't allocate memory: you tried "
                                                             "to allocate 8388608 bytes. Error code 12")],
                         ids=["MemoryError", "cpu_allocator"])
def test_out_of_memory_outside_a_step_is_one_paragraph_and_exit_7(exc, tiny_model_dir, data, tmp_path, monkeypatch,
                                                                    capsys):
    """Loading, an eval pass, a checkpoint: no split can help there, and a traceback would hide what happened."""
    import rocktune.tasks
    from rocktune.process.worker import run_in_process
    from tests.lm_runs import config

    def train(*args, **kwargs):
        raise exc

    monkeypatch.setattr(rocktune.tasks, "train", train)
    cfg = config(tiny_model_dir, data, tmp_path / "run")
    assert run_in_process(RunRequest(cfg, RunOptions(overwrite=True))) == exits.OUT_OF_MEMORY
    err = capsys.readouterr().err
    assert "out of memory outside a training step" in err and f"rocktune plan --model {tiny_model_dir}" in err
    assert ("8388608 bytes" in err) == isinstance(exc, RuntimeError) and "Traceback" not in err
