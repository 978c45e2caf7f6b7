"""platform/malloc.py: a training process keeps what a step frees (glibc's thresholds), counted in page faults, in
child processes: the setting is a whole process's and must never reach the test session's own."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from rocktune.train.request import RunOptions

pytestmark = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                                reason="glibc's mallopt: Linux with glibc only")

CHILD = """
import json, resource, sys, torch
from rocktune.platform.malloc import keep_freed_memory
note = keep_freed_memory() if sys.argv[1] == "1" else None

def step():  # a step's pattern: activations of 4 MiB alive together, a matmul, all freed at the end
    a = torch.ones(256, 1024, 4)
    b = a * 2
    c = b + a
    d = torch.randn(1024, 1024)
    return float(c.sum() + (d @ d).sum())

for _ in range(3):  # let glibc's dynamic threshold settle as it would in a run
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(50):
    step()
print(json.dumps({"note": note, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}))
"""


def _child(keep: bool, **env) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, "1" if keep else "0"], capture_output=True, text=True,
                         check=True, env={**os.environ, **env})
    return json.loads(out.stdout.splitlines()[-1])


def test_freed_memory_stays_for_the_next_step():
    plain, kept = _child(False), _child(True)
    assert "mmap threshold 32 MiB" in kept["note"]
    assert plain["faults"] > 10_000 and kept["faults"] < plain["faults"] / 5, (plain, kept)  # e.g. 47,552 and 5,121


def test_the_switch_leaves_malloc_alone():
    assert _child(True, ROCKTUNE_MALLOC="0")["note"] is None


def test_only_a_process_that_exists_for_the_run_sets_it():
    """train() inside a caller's process (a test session, a notebook, --no-supervise) leaves malloc alone; the
    CLI's worker process says it is the run's own."""
    from pathlib import Path

    assert RunOptions().own_process is False
    worker = Path(__file__).parents[1] / "src" / "rocktune" / "process" / "worker.py"
    assert "own_process=True" in worker.read_text().split('if __name__ == "__main__":')[1]
