"""``rocktune demo``: build the tiny model and task, train a LoRA, show that it learned."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from rocktune.config import config_from_dict
from rocktune.demo.task import DEMO_SKILLS, make_task, write_jsonl
from rocktune.demo.tiny import build_tiny_model
from rocktune.errors import UserError

DEMO_STEPS = 500  # on the plateau: every CPU variant tried gives 100% held-out (docs/testing.md)
MODEL_SHAPE = {"hidden": 128, "layers": 2, "heads": 4, "kv_heads": 2}


def demo_config(base: Path, data_dir: Path, run_dir: Path, steps: int) -> dict:
    return {
        "model": {"name_or_path": str(base)},
        "lora": {"r": 32, "alpha": 64},
        "data": {"train_file": str(data_dir / "train.jsonl"), "eval_file": str(data_dir / "eval.jsonl"),
                 "max_length": 64},
        "training": {"max_steps": steps, "micro_batch_size": 32, "lr": 3e-3, "warmup_steps": 20,
                     "eval_every": 0, "log_every": 10, "precision": "fp32", "device": "cpu", "seed": 0,
                     "sample_count": 3, "sample_max_new_tokens": 6},
        "output": {"dir": str(run_dir)},
    }


def run_demo(out_dir: str, as_json: bool, steps: int | None, overwrite: bool = False) -> int:
    from rocktune.tasks import train
    from rocktune.train.request import RunOptions

    out = Path(out_dir)
    settings = demo_config(out / "base_model", out / "data", out / "run", steps or DEMO_STEPS)
    check_demo_dir(out, settings, overwrite)
    cfg = config_from_dict(settings)
    build_tiny_model(out / "base_model", seed=0, **MODEL_SHAPE)
    train_rows, eval_rows = make_task(n_train=4000, n_eval=100, seed=0, skills=DEMO_SKILLS)
    write_jsonl(out / "data" / "train.jsonl", train_rows)
    write_jsonl(out / "data" / "eval.jsonl", eval_rows)
    t0 = time.perf_counter()
    # next: asks one of its own prompts beside the base model: the tiny model is no chat model (no --chat)
    result = train(cfg, RunOptions(overwrite=True, next_prompt=eval_rows[0]["prompt"]), quiet=as_json)
    seconds = time.perf_counter() - t0
    samples = generate(result.model, result.tokenizer, eval_rows)
    exact = sum(s["output"] == s["expected"] for s in samples) / len(samples)
    figures = {"eval_loss_before": result.eval_loss_before, "eval_loss_after": result.eval_loss_after,
               "exact_match": exact, "exact_match_by_skill": by_skill(samples), "run_dir": str(result.run_dir),
               "train_seconds": round(seconds, 1),
               "steps": result.steps, "report": write_run_report(result.run_dir)}
    if as_json:
        sys.stdout.write(json.dumps(figures) + "\n")
    else:
        shown: list[dict] = []
        for skill in DEMO_SKILLS:  # two of each skill
            shown += [s for s in samples if s["prompt"].startswith(skill)][:2]
        _print_summary(figures, shown)
    return 0


def by_skill(samples: list[dict]) -> dict[str, float]:
    """Held-out exact match per skill (the prompt's first word): a skill that fails shows by name."""
    out: dict[str, list[bool]] = {}
    for s in samples:
        out.setdefault(s["prompt"].split()[0], []).append(s["output"] == s["expected"])
    return {k: round(sum(v) / len(v), 4) for k, v in sorted(out.items())}


def check_demo_dir(out: Path, settings: dict, overwrite: bool) -> None:
    """Like ``train``: a demo run repeated as it was is redone; anything else in ``out`` is kept unless --overwrite.

    Only the demo's own ``settings`` are compared, so a field added to the config since that run is no difference.
    """
    import yaml

    from rocktune.train.rundir import CONFIG_NAME, diff_keys

    if overwrite or not out.exists() or not any(out.iterdir()):
        return
    saved = out / "run" / CONFIG_NAME
    if not saved.is_file():
        raise UserError(f"--out {out} exists and does not hold a rocktune demo; choose another --out, or pass "
                        "--overwrite to replace its contents.")
    changed = diff_keys(_project(yaml.safe_load(saved.read_text(encoding="utf-8")) or {}, settings), settings)
    if changed:
        raise UserError(f"--out {out} holds a different demo run (differs in {', '.join(changed[:6])}); choose "
                        "another --out, or pass --overwrite to replace it.")


def _project(saved, like):
    """``saved`` reduced to the key paths of ``like``, into lists too (a saved config writes every field of each
    list entry, e.g. GRPO's rewards with their defaults)."""
    if isinstance(like, list) and isinstance(saved, list) and len(like) == len(saved):
        return [_project(a, b) for a, b in zip(saved, like)]
    if not isinstance(like, dict):
        return saved
    saved = saved if isinstance(saved, dict) else {}
    return {k: _project(saved.get(k), v) for k, v in like.items()}


def generate(model, tokenizer, rows: list[dict]) -> list[dict]:
    """Greedy completions of the eval prompts, one by one (the model is tiny)."""
    import torch

    model.eval()
    out = []
    with torch.no_grad():
        for row in rows:
            ids = tokenizer(row["prompt"], return_tensors="pt")["input_ids"]
            gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=len(row["completion"]) + 2, eos_token_id=tokenizer.eos_token_id,
                                 pad_token_id=tokenizer.pad_token_id)
            text = tokenizer.decode(gen[0, ids.shape[1]:], skip_special_tokens=True)
            out.append({"prompt": row["prompt"], "expected": row["completion"], "output": text})
    return out


def _print_summary(fig: dict, samples: list[dict]) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from rocktune.tasks.causal.samples import visible

    console = Console()
    table = Table(title="rocktune demo: tiny Qwen2 + LoRA on upper-casing, letter shifting and letters as digits")
    table.add_column("figure")
    table.add_column("value", justify="right")
    table.add_row("eval loss before", f"{fig['eval_loss_before']:.4f}")
    table.add_row("eval loss after", f"{fig['eval_loss_after']:.4f}")
    table.add_row("held-out exact match", f"{fig['exact_match']:.0%}")
    for skill, rate in fig["exact_match_by_skill"].items():
        table.add_row(f"  {skill}", f"{rate:.0%}")
    table.add_row("training time", f"{fig['train_seconds']} s ({fig['steps']} steps)")
    console.print(table)
    for s in samples:
        mark = "[green]ok[/]" if s["output"] == s["expected"] else "[red]x[/]"
        output, expected = (escape(f"'{visible(s[k])}'") for k in ("output", "expected"))
        console.print(f"  {escape(s['prompt'])}{output:<10} expected {expected:<8} {mark}")
    console.print(f"adapter: {fig['run_dir']}/adapter")
    console.print(f"report: {fig['report']}" if fig["report"] else
                  "report: not written (pip install 'rocktune[report]' for plots and an HTML page of the run)")


def write_run_report(run_dir: Path) -> str | None:
    """The run's HTML report; None when the report extra (matplotlib) is not installed."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        return None
    from rocktune.report.run_report import write_report
    from rocktune.report.rundata import load_run

    return str(write_report([load_run(run_dir)]))


def demo(args) -> int:
    """``rocktune demo`` (task lm's registry ``demo`` hook): the tiny model learns a synthetic task."""
    return run_demo(out_dir=args.out or "runs/demo", as_json=args.json, steps=args.steps, overwrite=args.overwrite)


def merge_adapter(run: Path, target: Path, overwrite: bool) -> None:
    """A demo run's adapter merged into its base (the next stage starts from it), by ``rocktune export`` itself (what
    a user would run)."""
    cmd = [sys.executable, "-m", "rocktune", "export", str(run), "--to", "merged", "--out", str(target)]
    res = subprocess.run(cmd + (["--overwrite"] if overwrite else []), capture_output=True, text=True)
    if res.returncode != 0:
        raise UserError(f"merging the demo's SFT adapter failed: {res.stderr.strip()[-600:]}")
