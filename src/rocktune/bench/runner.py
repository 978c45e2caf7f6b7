"""Run the selected configurations one after another, each in its own subprocess, and summarise them.

All configurations share the model, the data, the optimizer steps and the samples per step; the thread count is
fixed for all of them so that ratios are fair on a shared CPU. Warm-up steps are run, recorded and excluded from
the medians.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from rocktune.bench import stats, workload
from rocktune.bench.configs import BASELINES, PARITY, BenchConfig, select
from rocktune.errors import UserError, first_line
from rocktune.platform.environment import resolve_device

COMMON = {"micro_batch_size": 2, "grad_accum": 4, "max_length": 512, "lr": 2e-4, "warmup_steps": 2,
          "scheduler": "cosine", "seed": 0, "lora_r": 16, "lora_alpha": 32}
# The targets for rocktune's default configuration, per device kind; MFU targets per GPU model shape.
# "best-hf": the fastest Hugging Face row that ran (hf-best when it ran; a baseline that failed is not a yardstick).
BEST_HF = "best-hf"
TARGETS = {"cpu": {"tokens_per_s_vs_hf-seed": 3.0, "tokens_per_s_vs_hf-tuned": 1.5, "memory_vs_hf-tuned": 0.6},
           "cuda": {"tokens_per_s_vs_hf-seed": 4.0, "tokens_per_s_vs_best-hf": 1.5, "memory_vs_best-hf": 1.0}}
MFU_CONVENTION = ("mfu: non-pad tokens/s x (4 x body matmul weights + attention) + loss-bearing tokens/s x 4 x head "
                  "weights, over the dense peak (the head's work counted where a loss needs it); mfu_all_token_head: "
                  "the head charged at every token (the common convention)")
MFU_TARGETS = {"qwen2.5-0.5b-shape": 0.30, "qwen2.5-1.5b-shape": 0.40}
PARITY_REL_TOL = 1e-3


@dataclass
class BenchRequest:
    """One ``rocktune bench`` measurement: the workload, the configurations and how they are timed."""

    model: str = "tiny"  # a named shape (tiny, qwen2.5-0.5b-shape...) or a model directory
    data: str | None = None  # a JSONL file; default: synthetic Alpaca-like records
    configs: str | None = None  # comma-separated names (rocktune bench --list); default: the device's set
    steps: int = 5  # measured optimizer steps per configuration
    warmup: int = 1  # steps run first and left out of the figures
    threads: int | None = None  # torch intra-op threads of each child (default: torch's own)
    device: str = "auto"
    out: str = "runs/bench"
    n_samples: int = 400  # synthetic records
    parity_steps: int = 4  # rocktune vs the HF Trainer on the same micro-batches; 0 skips it
    timeout: float = 1800.0  # seconds before one configuration is killed
    rounds: int = 1  # the whole set this many times, alternating the order
    common: dict | None = None  # overrides of the shared settings (global batch, max_length)
    token_range: tuple[int, int] | None = None  # the synthetic records' lengths
    nproc: int = 1  # also run rocktune on this many ranks


def run_bench(req: BenchRequest, log=print) -> dict:
    model, data, configs, steps, warmup = req.model, req.data, req.configs, req.steps, req.warmup
    threads, device, out, rounds, timeout = req.threads, req.device, req.out, req.rounds, req.timeout
    n_samples, parity_steps, token_range, nproc = req.n_samples, req.parity_steps, req.token_range, req.nproc
    common = {**COMMON, **(req.common or {})}
    if steps < 1:
        raise UserError(f"--steps must be at least 1 (measured optimizer steps), not {steps}")
    if warmup < 0 or parity_steps < 0 or rounds < 1:
        raise UserError("--warmup and --parity-steps cannot be negative; --rounds must be at least 1")
    if configs is not None:
        select(configs, "cpu")  # unknown names fail before torch is imported
    device = resolve_device(device)
    chosen = select(configs, device)
    threads = threads or _default_threads()
    out_dir = Path(out)
    cache = out_dir / "cache"
    model_dir = _prepare_model(model, cache)
    data_file = workload.data_file(data, n_samples, cache, token_range=token_range or workload.TOKEN_RANGE)
    lengths, loss_share = _data_lengths(model_dir, data_file, cache, common)
    base = {"model_dir": model_dir, "data_file": data_file, "cache_dir": str(cache / "tokens"), "device": device,
            "threads": threads, "common": common}
    if nproc > 1:
        from rocktune.bench.configs import on_ranks

        chosen = chosen + [on_ranks(nproc)]
    runs: dict[str, list[dict]] = {c.name: [] for c in chosen}
    for rnd in range(rounds):
        # Alternate the order so that a drift in the machine's load does not favour the configurations run first.
        for cfg in chosen if rnd % 2 == 0 else chosen[::-1]:
            log(f"bench: {cfg.name} ({warmup} warm-up + {steps} measured steps, round {rnd + 1}/{rounds})")
            runs[cfg.name].append(run_one(cfg, {**base, "steps": warmup + steps, "warmup": warmup}, out_dir,
                                          timeout))
            # each result on disk as it comes: a run cut short (the GPU check's time limit) keeps what finished
            (out_dir / "results").mkdir(parents=True, exist_ok=True)
            (out_dir / "results" / f"{cfg.name}-{rnd}.json").write_text(json.dumps(runs[cfg.name][-1]))
    results = [merge_rounds(r, warmup) for r in runs.values()]
    parity = None
    if parity_steps:
        log(f"bench: loss parity, {parity_steps} steps (rocktune vs HF Trainer on the same micro-batches)")
        pair = [run_one(PARITY[n], {**base, "steps": parity_steps}, out_dir, timeout) for n in PARITY]
        parity = _parity(*pair)
    report = summarise(results, 0, lengths, device, common)
    report["workload"] = {"model": model, "model_dir": model_dir, "data_file": data_file, "examples": len(lengths),
                          "mean_tokens": sum(lengths) / len(lengths), "loss_token_share": loss_share,
                          "warmup_steps_excluded": warmup, "measured_steps": steps * rounds, "rounds": rounds,
                          "threads": threads, "token_range": list(token_range or workload.TOKEN_RANGE), **common,
                          "samples_per_step": common["micro_batch_size"] * common["grad_accum"]}
    report["parity"] = parity
    report["targets"] = targets(report["configs"], parity, device, model)
    return report


def run_one(cfg: BenchConfig, spec: dict, out_dir: Path, timeout: float) -> dict:
    """Run one configuration in a fresh interpreter; the child writes its result file even when it fails."""
    run_dir = out_dir / "runs" / cfg.name
    spec = {**spec, "name": cfg.name, "kind": cfg.kind, "settings": cfg.settings, "run_dir": str(run_dir),
            "nproc": cfg.nproc}
    if cfg.needs_gpu and spec["device"] == "cpu":
        return {"name": cfg.name, "kind": cfg.kind, "status": "skipped", "reason": "needs a ROCm/CUDA device"}
    shutil.rmtree(run_dir, ignore_errors=True)  # a run cut short must not report an earlier run's metrics.jsonl
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        spec_file, result_file = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        spec_file.write_text(json.dumps(spec))
        env = {**os.environ, **{k: str(spec["threads"]) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")},
               "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
        try:
            proc = subprocess.run([sys.executable, "-m", "rocktune.bench.child", str(spec_file), str(result_file)],
                                  env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return partial_result(cfg.name, cfg.kind, run_dir, spec, f"timed out after {timeout:.0f} s")
        if not result_file.is_file():  # killed (e.g. by the kernel's OOM killer) before it could write
            tail = (proc.stderr or "").strip().splitlines()[-1:] or [f"exit status {proc.returncode}"]
            return {"name": cfg.name, "kind": cfg.kind, "status": "error", "reason": tail[0]}
        return json.loads(result_file.read_text())


STEP_KEYS = ("step", "loss", "tokens", "step_s", "real_tokens", "batch_tokens", "forwards", "compiling")


def partial_result(name: str, kind: str, run_dir: Path, spec: dict, reason: str) -> dict:
    """What a configuration cut by its time limit had done: the optimizer steps its ``metrics.jsonl`` holds (rocktune's
    loop writes one line per step, the HF baseline's timer too), warm-up steps kept for the losses and left out of
    the figures, and the largest step's device peak the loop logged. No result file, so no model shape (no MFU)."""
    path = Path(run_dir) / "metrics.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.is_file() else []
    steps = [{k: r.get(k) for k in STEP_KEYS} for r in rows if "loss" in r and r.get("step_s")]
    warmup = spec.get("warmup", 0)
    peaks = [r["peak_mem_bytes"] for r in rows if r.get("peak_mem_bytes")]
    memory = {"rss_growth_bytes": None, "source": "metrics.jsonl (the run was cut short)"}
    if spec.get("device") == "cuda":
        memory["device_peak_allocated_bytes"] = max(peaks) if peaks else None
    done = f"{len(steps)} steps done, {max(len(steps) - warmup, 0)} measured" if steps else "no step done"
    return {"name": name, "kind": kind, "status": "timeout", "reason": f"{reason} ({done})",
            "steps": steps[warmup:], "first_round_losses": [s["loss"] for s in steps], "first_round_steps": steps,
            "memory": memory, "partial": True}


def merge_rounds(rounds: list[dict], warmup: int) -> dict:
    """One result per configuration: the measured steps of every round pooled (warm-up steps of each round
    dropped), the memory of the round with the median peak; a failed round fails the configuration."""
    bad = next((r for r in rounds if r["status"] != "ok"), None)
    if bad is not None:
        return bad
    key = "device_peak_allocated_bytes" if "device_peak_allocated_bytes" in rounds[0]["memory"] else \
        "rss_growth_bytes"
    by_mem = sorted(rounds, key=lambda r: r["memory"][key] or 0)
    merged = {**rounds[0], "memory": by_mem[(len(by_mem) - 1) // 2]["memory"]}
    merged["steps"] = [s for r in rounds for s in r["steps"][warmup:]]
    merged["first_round_losses"] = [s["loss"] for s in rounds[0]["steps"]]
    merged["first_round_steps"] = rounds[0]["steps"]  # warm-up included: the memory peak covers every step
    return merged


def summarise(results: list[dict], warmup: int, lengths: list[int], device: str, common: dict | None = None) -> dict:
    common = common or COMMON
    rows = [_row(r, warmup, lengths) for r in results]
    best = compare(rows, common)
    env = next((r["environment"] for r in results if r.get("environment")), {})
    return {"schema": "rocktune-bench/1", "environment": env,
            "peak_memory_kind": "device max allocated" if device == "cuda" else "RSS growth over the loaded model",
            "mfu_convention": MFU_CONVENTION, "best_hf": best, "configs": rows}


# The figures a run's speed gives; a run whose loss did not fall has none of them (``_validate``).
SPEED_FIGURES = ("useful_tokens_per_s", "real_tokens_per_s", "step_s", "mfu", "mfu_all_token_head")


def _row(r: dict, warmup: int, lengths: list[int]) -> dict:
    cfg = _config(r["name"])
    row = {"name": r["name"], "kind": r["kind"], "description": cfg.description, "settings": cfg.settings,
           "status": r["status"], "reason": r.get("reason")}
    # a run cut by its time limit (status timeout) still reports the steps its metrics.jsonl held
    if r["status"] == "ok" or (r["status"] == "timeout" and r.get("steps")):
        row.update(_figures(r, warmup, lengths))
        _validate(row)
    return row


def _figures(r: dict, warmup: int, lengths: list[int]) -> dict:
    row = stats.summarise_steps(r["steps"], warmup)
    if r.get("first_round_losses"):  # every step of one whole run, warm-up included
        row.update(losses=r["first_round_losses"], final_loss=r["first_round_losses"][-1])
    # forwards and tokens processed (padding included) of every step of one run, warm-up included: the
    # largest forward is what the memory peak and the planner's estimate are about
    first = r.get("first_round_steps") or []
    row["forwards_per_step"] = [s.get("forwards") for s in first]
    row["tokens_per_step"] = [s.get("batch_tokens") for s in first]
    mem = r["memory"]
    row["memory"] = mem
    row["peak_memory_bytes"] = mem.get("device_peak_allocated_bytes", mem["rss_growth_bytes"])
    row["resolved"] = resolved = r.get("resolved") or {}
    # which attention ran (rocktune: its note, with why) and what compile fell back from
    row["attention"] = resolved.get("attention") or resolved.get("attn_implementation")
    row["compile_fallbacks"] = resolved.get("compile_fallbacks", [])
    row["fusion"] = resolved.get("fusion")  # liger | inductor | none: the Liger-vs-Inductor choice
    row["compiler"] = r.get("compiler") or {}  # graph breaks, recompiles, graphs (bench/compiler.py)
    # the device's own account (bench/device_time.py): step spans from CUDA events, and one profiled step's
    # kernels, busy share and time per kernel class; absent on a CPU
    row["device_time"] = resolved.get("device_time")
    row["device_busy_share"] = (row["device_time"] or {}).get("busy_share")
    shape = r.get("shape") or {}
    fpt = stats.flops_per_token(shape["matmul_params"], shape["layers"], shape["attn_dim"], lengths) \
        if shape else None
    row["model_flops_per_token"] = fpt
    peak = _peak(r.get("environment", {}), shape)
    row["mfu"] = stats.mfu(row["real_tokens_per_s"], fpt, peak,
                           (shape.get("head_params", 0), row["useful_tokens_per_s"]))
    row["mfu_all_token_head"] = stats.mfu(row["real_tokens_per_s"], fpt, peak)
    return row


def _validate(row: dict) -> None:
    """A speed of a run whose loss did not fall is no figure: it is kept aside, named invalid, and nothing (ratios,
    targets, the GPU check's lines) reads it."""
    losses = row.get("losses") or []
    row["loss_fell"] = stats.loss_fell(losses)
    if row["loss_fell"] is False:
        row["invalid_speed"] = {k: row.get(k) for k in SPEED_FIGURES}
        row.update(dict.fromkeys(SPEED_FIGURES))
        row["invalid_reason"] = (f"loss did not fall ({losses[0]:.4f} -> {losses[-1]:.4f} over {len(losses)} steps): "
                                 "the speed of a run that learns nothing is no figure")


def _has_figures(row: dict) -> bool:
    return "peak_memory_bytes" in row


def compare(rows: list[dict], common: dict) -> str | None:
    """Every row's ratios against each baseline and the fastest Hugging Face row (best-hf) that gave a valid speed
    (a baseline that failed is not a yardstick); returns that row's name. Rows from several bench runs can be
    compared once put together (``bench/check.py``: the GPU check runs one configuration per stage)."""
    by_name = {r["name"]: r for r in rows}
    ran = [r for r in rows if r["kind"] == "hf" and _has_figures(r) and r.get("useful_tokens_per_s")]
    best = max(ran, key=lambda r: r["useful_tokens_per_s"], default=None)
    for row in rows:
        row["ratios"] = {b: _ratios(row, by_name[b], common) for b in BASELINES
                         if b in by_name and _has_figures(by_name[b]) and _has_figures(row)}
        if best is not None and _has_figures(row):
            row["ratios"][BEST_HF] = {**_ratios(row, best, common), "against": best["name"]}
    return best["name"] if best else None


def _ratios(row: dict, base: dict, common: dict) -> dict:
    return {"tokens_per_s": stats.ratio(row["useful_tokens_per_s"], base["useful_tokens_per_s"]),
            "memory": stats.ratio(row["peak_memory_bytes"], base["peak_memory_bytes"]),
            "equal_micro_batch": _micro_batch(row, common) == _micro_batch(base, common)}


def _micro_batch(row: dict, common: dict) -> tuple:
    s = row["settings"]
    return (s.get("training.micro_batch_size", common["micro_batch_size"]), bool(s.get("data.packing")))


def targets(rows: list[dict], parity: dict | None, device: str = "cpu", model: str | None = None) -> dict:
    """The issue's targets, checked on rocktune's default configuration."""
    rt = next((r for r in rows if r["name"] == "rocktune" and (r["status"] == "ok" or _has_figures(r))), None)
    out = {}
    if device == "cuda" and model in MFU_TARGETS:
        value = (rt or {}).get("mfu")
        out["mfu"] = {"value": value, "target": MFU_TARGETS[model],
                      "met": None if value is None else value >= MFU_TARGETS[model]}
    for key, target in TARGETS["cuda" if device == "cuda" else "cpu"].items():
        metric, _, base = key.partition("_vs_")
        r = (rt or {}).get("ratios", {}).get(base, {})
        value = r.get("tokens_per_s" if metric == "tokens_per_s" else "memory")
        met = None if value is None else (value >= target if metric == "tokens_per_s" else value <= target)
        out[key] = {"value": value, "target": target, "met": met}
    out["loss_parity"] = {"value": parity and parity.get("max_rel_diff"), "target": PARITY_REL_TOL,
                          "met": parity.get("match") if parity else None}
    return out


def _parity(rt: dict, hf: dict) -> dict:
    if rt["status"] != "ok" or hf["status"] != "ok":
        bad = rt if rt["status"] != "ok" else hf
        return {"match": None, "reason": f"{bad['name']} {bad['status']}: {bad.get('reason')}"}
    out = stats.loss_parity([s["loss"] for s in rt["steps"]], [s["loss"] for s in hf["steps"]], PARITY_REL_TOL)
    out.update(rocktune_losses=[s["loss"] for s in rt["steps"]], hf_losses=[s["loss"] for s in hf["steps"]],
               same_tokens_per_step=[a["tokens"] == b["tokens"] for a, b in zip(rt["steps"], hf["steps"])],
               what="rocktune defaults (fp32, data.batch_order micro-batches, chunked loss) vs the hf-seed recipe "
                    "fed the same micro-batches in the same order (sequential sampler)")
    return out


def _config(name: str) -> BenchConfig:
    from rocktune.bench.configs import CONFIGS, VLM_CONFIGS

    return CONFIGS.get(name) or PARITY.get(name) or VLM_CONFIGS[name]


def _default_threads() -> int:
    import torch

    return torch.get_num_threads()


def _prepare_model(model: str, cache: Path) -> str:
    """Build a named shape, or check that the given model loads (config and tokenizer) before any child runs."""
    from rocktune.models.load import check_model_source, load_tokenizer

    path = workload.model_dir(model, cache)
    check_model_source(path)
    from transformers import AutoConfig

    try:
        AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise UserError(f"could not load model {model}: {first_line(exc)} "
                        f"(pass a local model directory or one of {', '.join(workload.SHAPES)})") from None
    load_tokenizer(path, False)
    return path


def _data_lengths(model_dir: str, data_file: str, cache: Path, common: dict) -> tuple[list[int], float]:
    """Tokenise once here (the children then hit the cache); lengths feed the attention FLOPs."""
    from rocktune.config import DataConfig
    from rocktune.data.dataset import prepare_data
    from rocktune.models.load import load_tokenizer

    d = DataConfig(train_file=data_file, eval_fraction=0.0, max_length=common["max_length"])
    ex, _, _ = prepare_data(d, load_tokenizer(model_dir, False), cache / "tokens", common["seed"])
    loss = sum(sum(1 for t in y[1:] if t != -100) for y in ex.labels)
    return ex.lengths(), loss / sum(ex.lengths())


def _peak(env: dict, shape: dict) -> float | None:
    from rocktune.bench.peaks import peak_flops

    return peak_flops(env.get("gpu"), shape.get("dtype", "float32"))
