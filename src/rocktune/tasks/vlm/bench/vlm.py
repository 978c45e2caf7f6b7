"""``rocktune bench --suite vlm``: task=vlm against the Hugging Face Trainer + PEFT (tasks/vlm/bench/hf_vlm.py) on the
same tiny random-init Qwen2.5-VL (tasks/vlm/demo/tiny_vlm.py), the same conversations (the colour task,
tasks/vlm/demo/vision_task.py), the same LoRA on the language model, batch, schedule and steps, both in fp32. Each side
runs in its own process as the text rows do (bench/runner.py), and the report has the same shape: useful (loss-bearing)
tokens/s, the peak memory, and the ratios against the HF row.
"""

from __future__ import annotations

from pathlib import Path

from rocktune.bench.configs import VLM_CONFIGS
from rocktune.bench.runner import BEST_HF, COMMON, BenchRequest, merge_rounds, run_one, summarise

# The colour task's conversations are short (4 image tokens, a one-word answer): a higher rate than the text rows'
# so that the loss falls within the few steps measured (a run whose loss did not fall has no speed figure).
VLM_COMMON = {**COMMON, "micro_batch_size": 4, "grad_accum": 2, "max_length": 128, "lr": 5e-3}


def run_vlm_bench(req: BenchRequest, log=print) -> dict:
    from rocktune.tasks.vlm.bench.hf_vlm import encoded
    from rocktune.tasks.vlm.demo.tiny_vlm import build_tiny_vlm
    from rocktune.tasks.vlm.demo.vision_task import write_colour_task
    from rocktune.platform.environment import resolve_device

    device = resolve_device(req.device)
    out = Path(req.out)
    cache = out / "cache"
    model_dir = cache / "tiny-vlm"
    if not (model_dir / "config.json").is_file():
        build_tiny_vlm(model_dir)
    common = {**VLM_COMMON, **(req.common or {})}
    per_step = common["micro_batch_size"] * common["grad_accum"]
    data_file, _ = write_colour_task(cache / "colours", n_train=per_step * (req.steps + req.warmup), n_eval=0,
                                     seed=common["seed"])
    examples, _, _ = encoded(str(model_dir), str(data_file), common["max_length"])
    lengths = [len(e.input_ids) for e in examples]
    base = {"model_dir": str(model_dir), "data_file": str(data_file), "cache_dir": str(cache / "tokens"),
            "device": device, "threads": req.threads or _threads(), "common": common,
            "steps": req.warmup + req.steps, "warmup": req.warmup}
    runs: dict[str, list[dict]] = {name: [] for name in VLM_CONFIGS}
    for rnd in range(req.rounds):  # the order alternates, as for the text rows: a drift in load favours neither
        for cfg in list(VLM_CONFIGS.values())[:: 1 if rnd % 2 == 0 else -1]:
            log(f"bench vlm: {cfg.name} ({req.warmup} warm-up + {req.steps} measured steps, round {rnd + 1}/"
                f"{req.rounds})")
            runs[cfg.name].append(run_one(cfg, base, out, req.timeout))
    results = [merge_rounds(r, req.warmup) for r in runs.values()]
    report = summarise(results, 0, lengths, device, common)
    report["workload"] = {"model": "tiny Qwen2.5-VL (tasks/vlm/demo/tiny_vlm.py)", "model_dir": str(model_dir),
                          "data_file": str(data_file), "examples": len(examples),
                          "mean_tokens": sum(lengths) / len(lengths),
                          "images_per_example": sum(len(e.images) for e in examples) / len(examples),
                          "loss_token_share": sum(sum(t != -100 for t in e.labels[1:]) for e in examples) /
                          sum(lengths), "warmup_steps_excluded": req.warmup, "measured_steps": req.steps * req.rounds,
                          "rounds": req.rounds,
                          "threads": base["threads"], "samples_per_step": per_step, **common}
    rt = next(r for r in report["configs"] if r["name"] == "vlm-rocktune")
    against = rt.get("ratios", {}).get(BEST_HF, {})  # the HF row, when it gave a valid speed
    report["vlm"] = {"tokens_per_s_vs_hf": against.get("tokens_per_s"), "memory_vs_hf": against.get("memory")}
    return report


def _threads() -> int:
    import torch

    return torch.get_num_threads()
