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
    # the run's steps rebuilt from its workload; its first step, one forward of 34 rows x 2,048, sets the peak
    assert (s.micro_batch, s.seq_len, s.precision, s.attn, s.compiled, s.kv_copies) == \
        (34, 2048, "bf16", "varlen", True, True)
    assert "[34, 40, 37, 31, 39] rows" in case.source
    assert case.measured == 49_844_244_992  # read from the JSON: 46.4 GiB
    assert abs(case.error) < 0.02  # measured: -0.8%
    # what the planner said before it knew varlen: the forward sized as padded SDPA, 2.4x the measured peak
    sdpa = estimate(case.shape, replace(s, attn="sdpa", padded=True, compiled=False)).peak_allocated
    assert sdpa / case.measured > 2.3
