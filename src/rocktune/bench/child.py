"""One benchmark configuration in its own process: ``python -m rocktune.bench.child SPEC.json RESULT.json``.

A fresh process per configuration gives each one a clean memory peak and no warm caches from the others.
The result file always gets written: ``status`` ok | skipped (with the reason) | error (with the message).
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path
from rocktune.errors import one_line


def rocktune_config(spec: dict) -> dict:
    """Common bench settings + the configuration's dotted overrides -> a RunConfig dict."""
    c = spec["common"]
    raw = {
        "model": {"name_or_path": spec["model_dir"]},
        "lora": {"r": c["lora_r"], "alpha": c["lora_alpha"], "dropout": 0.0, "target_modules": "all-linear"},
        "data": {"train_file": spec["data_file"], "eval_fraction": 0.0, "max_length": c["max_length"],
                 "cache_dir": spec["cache_dir"]},
        "training": {"max_steps": spec["steps"], "micro_batch_size": c["micro_batch_size"],
                     "grad_accum": c["grad_accum"], "lr": c["lr"], "warmup_steps": c["warmup_steps"],
                     "scheduler": c["scheduler"], "eval_every": 0, "log_every": 1, "device": spec["device"],
                     "seed": c["seed"]},
        "reliability": {"save_every": 0},
        "output": {"dir": spec["run_dir"]},
    }
    for key, value in spec["settings"].items():
        node = raw
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return raw


def run_rocktune(spec: dict, probe) -> tuple[list[dict], dict]:
    from rocktune.config import config_from_dict
    from rocktune.tasks import train
    from rocktune.train.request import RunOptions

    raw = rocktune_config(spec)
    clock = device_clock(spec, raw)
    if spec.get("nproc", 1) > 1:
        _run_ranks(raw, spec["nproc"], spec["threads"])
        probe.loaded = {}
    else:
        def step_done(step):
            probe.step_done(step)
            if clock is not None:
                clock.step_done(step)

        # RSS growth counts from the moment the model with its adapter exists, as for the HF baselines.
        train(config_from_dict(raw), RunOptions(overwrite=True), quiet=True, on_ready=probe.mark_loaded,
              on_step_done=step_done)
    rows = [json.loads(line) for line in (Path(spec["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    steps = [{"step": r["step"], "loss": r["loss"], "tokens": r["tokens"], "step_s": r["step_s"],
              "real_tokens": r["real_tokens"], "batch_tokens": r["batch_tokens"],
              "device_wait_s": r.get("device_wait_s"), "forwards": r.get("forwards"), "compiling": r.get("compiling"),
              "profiled": clock is not None and r["step"] == clock.sample}
             for r in rows if "loss" in r]
    timing = clock.report(list(range(spec.get("warmup", 0) + 1, clock.sample))) if clock is not None else None
    return steps, {"config": raw, **ran(Path(spec["run_dir"]), rows), **memory_facts(raw, spec["device"]),
                   "device_time": timing}


def device_clock(spec: dict, raw: dict, cuda=None, profile=None):
    """On a GPU (one process, not the parity pair): one step more than asked, profiled, and a CUDA event after
    every step (``bench/device_time.py``); the profiled step is left out of the speed figures. ``cuda`` and
    ``profile`` are torch's unless a test gives fakes."""
    if spec["device"] != "cuda" or spec.get("nproc", 1) > 1 or spec["name"].startswith("parity"):
        return None
    from rocktune.bench.device_time import DeviceClock

    raw["training"]["max_steps"] += 1
    return DeviceClock(sample=raw["training"]["max_steps"], cuda=cuda, profile=profile)


def ran(run_dir: Path, rows: list[dict]) -> dict:
    """What the run actually used, from its run_info.json and metrics: the attention and why, whether the decoder
    was compiled and who fused the layer's elementwise work (liger | inductor | none, with why), every compile
    failure it fell back from (step and message), the precision and the planner's predicted peak."""
    path = run_dir / "run_info.json"
    info = json.loads(path.read_text()) if path.is_file() else {}
    notes = info.get("notes", [])
    attention = next((n.removeprefix("attention: ") for n in notes if n.startswith("attention: ")), None)
    if attention is None:  # no note (examples on a CPU, or a set value): the resolved setting says it
        attention = next((n for n in notes if n.startswith("attn_implementation")), None)
    # who fused the work around the matmuls: Liger's kernels, Inductor's own fusion, or none (build.fusion's note)
    fusion = next((n.removeprefix("fusion: ") for n in notes if n.startswith("fusion: ")), None)
    return {"attention": attention, "compiled": any(n.startswith("torch.compile applied") for n in notes),
            "fusion": fusion.split(" ", 1)[0] if fusion else None, "fusion_note": fusion,
            "compile_fallbacks": [{"step": r["step"], "error": r["compile_fallback"]} for r in rows
                                  if r.get("compile_fallback")],
            "precision": info.get("precision"), "predicted_peak_bytes": info.get("predicted_peak_bytes")}


def memory_facts(raw: dict, device: str) -> dict:
    """What the memory planner needs to size this run again (tests/test_planner_gpu_runs.py): the loss chunk, and
    whether the varlen glue repeats K/V for this torch's kernel."""
    from rocktune.kernels.attention import repeats_kv
    from rocktune.tasks.causal.autofit import loss_chunk

    setting = raw["training"].get("loss_chunk_size", "auto")
    return {"loss_chunk": loss_chunk(setting, "cuda" if device == "cuda" else "cpu"), "varlen_kv_copies": repeats_kv()}


def _run_ranks(raw: dict, nproc: int, threads: int) -> None:
    """``rocktune train --nproc N`` as a user runs it (torchrun, the same global batch), threads split between the
    ranks on a CPU. The peak memory of worker processes is not measured here (reported as absent)."""
    import os
    import subprocess

    import yaml

    cfg = Path(raw["output"]["dir"]).with_suffix(".yaml")
    cfg.parent.mkdir(parents=True, exist_ok=True)
    cfg.write_text(yaml.safe_dump(raw))
    per_rank = str(max(1, threads // nproc))
    env = {**os.environ, "OMP_NUM_THREADS": per_rank, "MKL_NUM_THREADS": per_rank}
    proc = subprocess.run([sys.executable, "-m", "rocktune", "train", "-c", str(cfg), "--no-supervise", "--overwrite",
                           "--nproc", str(nproc)], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"rocktune train --nproc {nproc} failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")


def main(spec_path: str, result_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    result: dict = {"name": spec["name"], "kind": spec["kind"], "status": "ok"}
    try:
        result.update(_run(spec))
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the report, not kill the bench
        from rocktune.bench.hf_baseline import SkipBaseline

        skipped = isinstance(exc, SkipBaseline)
        result.update(status="skipped" if skipped else _failure_status(exc), reason=one_line(exc))
        if not skipped:
            result["traceback"] = traceback.format_exc(limit=6)
    Path(result_path).write_text(json.dumps(result))
    return 0


def _run(spec: dict) -> dict:
    import os

    import torch

    from rocktune.bench.compiler import CompilerRecord
    from rocktune.bench.measure import MemoryProbe, environment
    from rocktune.models.load import quiet_transformers

    torch.set_num_threads(spec["threads"])
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    quiet_transformers()
    device = spec["device"]
    if device == "cuda" and not torch.cuda.is_available():
        from rocktune.bench.hf_baseline import SkipBaseline

        raise SkipBaseline("no ROCm/CUDA device is visible to torch")
    probe = MemoryProbe(device)
    probe.journal = Path(spec["run_dir"]) / "metrics.jsonl"  # the HF side's steps as they come (a run cut short)
    compiler = CompilerRecord().start()
    if spec["kind"] == "rocktune":
        steps, resolved = run_rocktune(spec, probe)
    elif spec["settings"].get("task") == "vlm":
        from rocktune.tasks.vlm.bench.hf_vlm import run_hf_vlm

        steps, resolved = run_hf_vlm(spec, probe)
    else:
        steps, resolved = _run_hf(spec, probe)
    return {"steps": steps, "resolved": resolved, "memory": probe.report(), "shape": probe.shape,
            "environment": environment(device, torch.get_num_threads()), "compiler": compiler.report()}


def _run_hf(spec: dict, probe) -> tuple[list[dict], dict]:
    from rocktune.bench.hf_baseline import run_hf
    from rocktune.config import DataConfig
    from rocktune.data.dataset import prepare_data
    from rocktune.models.load import load_tokenizer

    c = spec["common"]
    tokenizer = load_tokenizer(spec["model_dir"], False)
    d = DataConfig(train_file=spec["data_file"], eval_fraction=0.0, max_length=c["max_length"])
    examples, _, _ = prepare_data(d, tokenizer, Path(spec["cache_dir"]), c["seed"])
    order = _rocktune_order(examples.lengths(), c, spec["steps"]) if spec["settings"]["sampler"] == \
        "rocktune-order" else None
    return run_hf(spec["model_dir"], examples, spec["settings"], spec["steps"], c, spec["device"], probe, order)


def _rocktune_order(lengths: list[int], c: dict, steps: int) -> list[int]:
    """The example order of rocktune's micro-batches (data.batch_order's default) over as many epochs as ``steps``
    needs."""
    from rocktune.data.batching import epoch_batches

    need = steps * c["grad_accum"]
    batches: list[list[int]] = []
    epoch = 0
    while len(batches) < need:
        batches += epoch_batches(lengths, c["micro_batch_size"], c["seed"], epoch)
        epoch += 1
    # HF's DataLoader cuts fixed-size batches: only full micro-batches keep the two sides aligned.
    full = [b for b in batches[:need] if len(b) == c["micro_batch_size"]]
    if len(full) < need:
        raise ValueError("rocktune's order has a short micro-batch within the parity steps; use fewer steps")
    return [i for b in full for i in b]


def _failure_status(exc: BaseException) -> str:
    text = str(exc).lower()
    return "oom" if "out of memory" in text or type(exc).__name__ == "OutOfMemoryError" else "error"



if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
