"""``rocktune demo --task grpo``: reinforcement learning with a verifiable reward after a short SFT, on the CPU.

The built-in tiny model is first taught the demo's skills by SFT for a few steps only (``SFT_STEPS``): it has learned
the answers' shape but gets few of them exactly right. That adapter, merged into its base, is where GRPO starts and,
with the new adapter off, its reference. GRPO then samples groups of answers to the same prompts, rewards each
exactly right one with 1 (the ``exact`` reward against the prompt's answer) and pushes the policy towards the better
ones of each group. On held-out prompts it shows greedy exact match before (where SFT left it) and after.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
import time
from pathlib import Path
from typing import Any, cast

from rocktune.config import config_from_dict
from rocktune.demo.run import (MODEL_SHAPE, by_skill, check_demo_dir, demo_config, generate, merge_adapter,
                               write_run_report)
from rocktune.demo.task import make_task, write_jsonl
from rocktune.demo.tiny import build_tiny_model

SKILLS = ("upper",)  # one per-letter rule: partly learned by a short SFT, finished by reward alone
SFT_STEPS = 45  # the answers' shape (a space, four capitals, EOS), few of them right
GRPO_STEPS = 120


def grpo_config(base: Path, data_dir: Path, run_dir: Path, steps: int) -> dict:
    return {"task": "grpo", "model": {"name_or_path": str(base)}, "lora": {"r": 16, "alpha": 32},
            "data": {"train_file": str(data_dir / "prompts_train.jsonl"), "eval_fraction": 0.0, "max_length": 32},
            "grpo": {"num_generations": 8, "max_completion_length": 8, "beta": 0.0, "loss_type": "dapo",
                     # the byte-level tiny model's tail is wide: at 1.0 few sampled answers are right (3% here)
                     "temperature": 0.5,
                     "rewards": [{"function": "exact"}]},
            # 16 prompts x 8 completions a step; a higher rate (4e-3 with half the prompts) collapsed the reward
            "training": {"max_steps": steps, "micro_batch_size": 64, "grad_accum": 2, "lr": 3e-3, "warmup_steps": 10,
                         "eval_every": 0, "log_every": 5, "precision": "fp32", "device": "cpu", "seed": 0},
            "output": {"dir": str(run_dir)}}


def run_grpo_demo(out_dir: str, as_json: bool, steps: int | None, overwrite: bool = False,
                  sft_steps: int = SFT_STEPS) -> int:
    from rocktune.tasks import train
    from rocktune.train.request import RunOptions

    out = Path(out_dir)
    settings = grpo_config(out / "sft_merged", out / "data", out / "run", steps or GRPO_STEPS)
    check_demo_dir(out, settings, overwrite)
    train_rows, eval_rows = make_task(n_train=2000, n_eval=100, seed=0, skills=SKILLS)
    t0 = time.perf_counter()
    _partial_sft(out, train_rows, eval_rows, sft_steps, as_json)
    sft_seconds = time.perf_counter() - t0
    write_jsonl(out / "data" / "prompts_train.jsonl",
                [{"prompt": r["prompt"], "answer": r["completion"]} for r in train_rows])
    t0 = time.perf_counter()
    # next: asks one of its own prompts beside the SFT model: the tiny model is no chat model (no --chat)
    result = train(config_from_dict(settings), RunOptions(overwrite=True, next_prompt=eval_rows[0]["prompt"]),
                   quiet=as_json)
    seconds = time.perf_counter() - t0
    model, tokenizer = cast(Any, result.model), result.tokenizer  # the PEFT model the run trained
    with model.disable_adapter():  # the SFT model: where GRPO started, and its reference
        before = generate(model, tokenizer, eval_rows)
    after = generate(model, tokenizer, eval_rows)
    rewards = [json.loads(x) for x in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward"] for r in rewards if "reward" in r]
    figures = {"exact_match_before": _exact(before), "exact_match_after": _exact(after),
               "exact_match_by_skill_after": by_skill(after), "train_reward_first": rewards[0] if rewards else None,
               "train_reward_last": rewards[-1] if rewards else None, "sft_steps": sft_steps,
               "sft_seconds": round(sft_seconds, 1), "train_seconds": round(seconds, 1), "steps": result.steps,
               "run_dir": str(result.run_dir), "report": write_run_report(result.run_dir),
               "examples": [{"prompt": b["prompt"], "before": b["output"], "after": a["output"]}
                            for b, a in zip(before[:4], after[:4])]}
    if as_json:
        sys.stdout.write(json.dumps(figures) + "\n")
    else:
        _print_summary(figures)
    return 0


def _exact(samples: list[dict]) -> float:
    return sum(s["output"] == s["expected"] for s in samples) / len(samples)


def _partial_sft(out: Path, train_rows: list[dict], eval_rows: list[dict], steps: int, as_json: bool) -> None:
    """The SFT demo's recipe, stopped early, merged into the tiny base by ``rocktune export`` (what a user runs)."""
    from rocktune.tasks import train
    from rocktune.train.request import RunOptions

    build_tiny_model(out / "base_model", seed=0, **MODEL_SHAPE)
    write_jsonl(out / "data" / "train.jsonl", train_rows)
    write_jsonl(out / "data" / "eval.jsonl", eval_rows)
    cfg = demo_config(out / "base_model", out / "data", out / "sft", steps)
    # a constant rate: stopping early is then what leaves it partly trained, not a schedule that ran out
    cfg["training"].update({"sample_count": 0, "warmup_steps": min(20, steps // 4), "scheduler": "constant"})
    if not as_json:
        print(f"SFT first, {steps} steps (a partly trained adapter for GRPO to start from)", file=sys.stderr)
    with contextlib.redirect_stdout(io.StringIO()):
        train(config_from_dict(cfg), RunOptions(overwrite=True), quiet=True)
    merge_adapter(out / "sft", out / "sft_merged", overwrite=True)


def _print_summary(fig: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(title="rocktune demo --task grpo: the exact-answer reward after a short SFT")
    table.add_column("held-out prompts")
    table.add_column("after SFT", justify="right")
    table.add_column("after GRPO", justify="right")
    table.add_row("greedy answer exactly right", f"{fig['exact_match_before']:.0%}", f"{fig['exact_match_after']:.0%}")
    console.print(table)
    for ex in fig["examples"]:
        console.print(f"  {ex['prompt']} SFT {ex['before']!r:<10} GRPO {ex['after']!r}", markup=False)
    console.print(f"rollout reward {fig['train_reward_first']:.2f} -> {fig['train_reward_last']:.2f}; SFT "
                  f"{fig['sft_seconds']} s ({fig['sft_steps']} steps), GRPO {fig['train_seconds']} s "
                  f"({fig['steps']} steps); adapter: {fig['run_dir']}/adapter")
    console.print(f"report: {fig['report']}" if fig["report"] else
                  "report: not written (pip install 'rocktune[report]' for plots and an HTML page of the run)")


def demo(args) -> int:
    """``rocktune demo --task grpo`` (its registry ``demo`` hook): a short SFT, then GRPO with the exact-answer
    reward."""
    return run_grpo_demo(out_dir=args.out or "runs/demo-grpo", as_json=args.json, steps=args.steps,
                         overwrite=args.overwrite)
