"""The memory planner against every GPU run's measured peak (docs/gpu-runs), and the first H200 run's in detail.

Each rocktune row of a bench suite file and each profile under docs/gpu-runs that records a measured peak becomes a
case (``rocktune.bench.peak_check``): the run's largest forward sized again by the planner must be within 15% of
the peak the device measured. A new run folder is checked by adding it; nothing here is retyped from a run.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from rocktune.bench import peak_check
from rocktune.planner.estimate import estimate

RUNS = Path(__file__).parents[1] / "docs" / "gpu-runs"
CASES = peak_check.cases(RUNS)
H200 = "2026-11-26-h200/suite-0.5b-rocktune.json#rocktune"


def test_every_run_folder_with_a_measured_peak_gives_cases():
    folders = {p.parent.relative_to(RUNS).parts[0] for p in RUNS.rglob("*.json")
               if "peak_allocated_bytes" in p.read_text() or "device_peak_allocated_bytes" in p.read_text()}
    assert folders and folders == {c.name.split("/")[0] for c in CASES}
    assert H200 in {c.name for c in CASES}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_planner_peak_within_15_percent_of_the_measured_one(case):
    assert abs(case.error) <= 0.15, (case.name, case.source, case.predicted, case.measured)


def test_the_first_h200_runs_configuration_worked_out_from_its_files():
    case = next(c for c in CASES if c.name == H200)
    s = case.spec
    # the run's steps rebuilt from its workload: 34 rows per forward (its planner's choice, all a step holds); the
    # loop reset the peak counters as each step started, so the peak read at the end is step 5's, whose 39 rows ran
    # as forwards of 19 and 20 rows of 2,048 tokens
    assert (s.micro_batch, s.seq_len, s.precision, s.attn, s.compiled, s.kv_copies) == \
        (20, 2048, "bf16", "varlen", True, True)
    assert "[34, 40, 37, 31, 39] rows, 34 rows per forward" in case.source and "[19, 20] rows" in case.source
    assert case.measured == 49_844_244_992  # read from the JSON: 46.4 GiB
    assert -0.10 < case.error < 0  # -8.4%: the check assumes the compiled loss chunk; that run's was eager
    # what the planner said before it knew varlen: that forward sized as padded SDPA, 1.4x the measured peak
    sdpa = estimate(case.shape, replace(s, attn="sdpa", padded=True, compiled=False)).peak_allocated
    assert sdpa / case.measured > 1.35
