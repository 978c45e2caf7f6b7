"""Named benchmark suites: one command that measures what an issue's targets are about.

``gpu``: both Qwen2.5 shapes (random init, built once and cached), bf16, a realistic SFT workload — 64 examples
of 50-2,000 tokens per optimizer step, max_length 2,048, 2 warm-up and 8 measured steps — and the configurations
the GPU targets compare: rocktune's defaults against an expert's HF setup, plus the switches that explain the gap
(compile; Liger against Inductor's fusion). Each model's report is written as soon as it is done, so a later
failure loses nothing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

from rocktune.bench.runner import BenchRequest
from rocktune.errors import UserError


@dataclass(frozen=True)
class Suite:
    models: tuple[str, ...]
    configs: str
    common: dict = field(default_factory=dict)
    token_range: tuple[int, int] = (50, 500)
    steps: int = 3
    warmup: int = 1
    parity_steps: int = 0

    def dry(self) -> Suite:
        """The same configurations and code paths on a small workload: a CPU check of the suite, not a measurement."""
        return replace(self, common={"micro_batch_size": 4, "grad_accum": 2, "max_length": 256},
                       token_range=(50, 250), steps=1, warmup=1)

    def samples(self) -> int:
        """Enough examples for every step to be a full one: the warm-up and measured steps, and the profiled step
        a GPU run adds (bench/device_time.py)."""
        per_step = self.common["micro_batch_size"] * self.common["grad_accum"]
        return per_step * (self.steps + self.warmup + 1)


SUITES = {
    "gpu": Suite(models=("qwen2.5-0.5b-shape", "qwen2.5-1.5b-shape"),
                 configs="hf-best,rocktune,rt-no-compile,rt-liger",
                 common={"micro_batch_size": 8, "grad_accum": 8, "max_length": 2048}, token_range=(50, 2000),
                 steps=8, warmup=2),  # two warm-up steps: compilation, and a Dynamo recompile for new shapes
}


def run_suite(name: str, model: str | None, device: str, out: str, timeout: float, run_bench, log,
              configs: str | None = None) -> dict:
    """``model``: one of the suite's shapes runs alone, at the suite's workload (the GPU check runs one shape per
    part); any other model replaces the suite's and shrinks its workload (``tiny``: a CPU dry run of the whole suite).
    ``configs`` replaces the suite's configurations (a part with less time runs fewer)."""
    if name not in SUITES:
        raise UserError(f"unknown bench suite {name!r}; known: {', '.join(SUITES)}")
    suite = SUITES[name] if model is None or model in SUITES[name].models else SUITES[name].dry()
    suite = replace(suite, configs=configs) if configs else suite
    reports = {}
    for shape in (model,) if model else suite.models:
        log(f"bench suite {name}: {shape}")
        report = run_bench(BenchRequest(model=shape, configs=suite.configs, steps=suite.steps, warmup=suite.warmup,
                                        device=device, out=str(Path(out) / shape), n_samples=suite.samples(),
                                        parity_steps=suite.parity_steps, timeout=timeout, common=suite.common,
                                        token_range=suite.token_range), log)
        reports[shape] = report
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / f"report-{shape}.json").write_text(json.dumps(report, indent=1))
    return {"schema": "rocktune-bench-suite/1", "suite": name, "reports": reports}
