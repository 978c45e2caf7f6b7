"""``rocktune demo --task dpo``: preference tuning after SFT, the ordinary next step, on the built-in tiny model.

It starts from the SFT demo's adapter (``rocktune demo``'s run in ``--from``, trained first when there is none),
merged into its base: that merged model is what DPO improves and, with the new adapter off, its reference. The pairs
are the SFT task's prompts with two right answers in two styles, the preferred one ending with "!"
(tasks/preference/demo/pairs.py). On held-out prompts it shows how often the preferred answer wins — has the higher
log-probability under the model — before and after, and how many greedy answers now take the preferred style.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
import time
from pathlib import Path

from rocktune.config import config_from_dict
from rocktune.demo.run import check_demo_dir, generate, merge_adapter, write_run_report
from rocktune.demo.task import DEMO_SKILLS, write_jsonl
from rocktune.tasks.preference.demo.pairs import STYLE, make_pairs

DPO_STEPS = 30
SFT_STEPS = 400  # when there is no SFT demo run to start from: enough for the task's answer shapes


def dpo_config(base: Path, data_dir: Path, run_dir: Path, steps: int) -> dict:
    return {"task": "dpo", "model": {"name_or_path": str(base)}, "lora": {"r": 16, "alpha": 32},
            "data": {"train_file": str(data_dir / "pairs_train.jsonl"),
                     "eval_file": str(data_dir / "pairs_eval.jsonl"), "max_length": 64},
            "preference": {"beta": 0.1},
            "training": {"max_steps": steps, "micro_batch_size": 16, "lr": 2e-3, "warmup_steps": 4, "eval_every": 0,
                         "log_every": 5, "precision": "fp32", "device": "cpu", "seed": 0},
            "output": {"dir": str(run_dir)}}


def run_dpo_demo(out_dir: str, sft_dir: str, as_json: bool, steps: int | None, overwrite: bool = False) -> int:
    from peft import PeftModel

    from rocktune.tasks import train
    from rocktune.train.request import RunOptions

    out, sft = Path(out_dir), Path(sft_dir)
    settings = dpo_config(out / "sft_merged", out / "data", out / "run", steps or DPO_STEPS)
    check_demo_dir(out, settings, overwrite)
    if not (sft / "run" / "adapter").is_dir():
        _sft_demo(sft, as_json)
    merge_adapter(sft / "run", out / "sft_merged", overwrite=True)
    train_rows, eval_rows = make_pairs(n_train=512, n_eval=64, seed=0, skills=DEMO_SKILLS)  # the SFT demo's skills
    write_jsonl(out / "data" / "pairs_train.jsonl", train_rows)
    write_jsonl(out / "data" / "pairs_eval.jsonl", eval_rows)
    t0 = time.perf_counter()
    # next: asks one of its own prompts beside the SFT model: the tiny model is no chat model (no --chat)
    result = train(config_from_dict(settings), RunOptions(overwrite=True, next_prompt=eval_rows[0]["prompt"]),
                   quiet=as_json)
    seconds = time.perf_counter() - t0
    model, tokenizer = result.model, result.tokenizer
    # a fresh run (overwrite, no resume) returns the model it trained: build.model_with_adapter's PEFT model
    assert isinstance(model, PeftModel)
    with model.disable_adapter():  # the SFT model: DPO's starting point and reference
        before = preference_figures(model, tokenizer, eval_rows)
    after = preference_figures(model, tokenizer, eval_rows)
    figures = {"preferred_wins_before": before["wins"], "preferred_wins_after": after["wins"],
               "styled_answers_before": before["styled"], "styled_answers_after": after["styled"],
               "exact_preferred_before": before["exact"], "exact_preferred_after": after["exact"],
               "eval_loss_before": result.eval_loss_before, "eval_loss_after": result.eval_loss_after,
               "run_dir": str(result.run_dir), "sft_run": str(sft / "run"), "train_seconds": round(seconds, 1),
               "steps": result.steps, "report": write_run_report(result.run_dir), "examples": after["examples"][:4]}
    if as_json:
        sys.stdout.write(json.dumps(figures) + "\n")
    else:
        _print_summary(figures, before["examples"][:4])
    return 0


def preference_figures(model, tokenizer, pairs: list[dict]) -> dict:
    """``wins``: the share of held-out pairs whose preferred answer has the higher log-probability under ``model``;
    ``styled``: the share of greedy answers that end in the preferred style."""
    import torch

    from rocktune.tasks.preference.pairs import PairText, encode_pair, pair_set
    from rocktune.tasks.preference.feed import collate_pairs
    from rocktune.tasks.preference.loss import sequence_logps

    encoded = pair_set([encode_pair(PairText(p["prompt"], p["chosen"], p["rejected"], False), tokenizer, 64,
                                    "prompt", f"pair {i}") for i, p in enumerate(pairs)])
    model.eval()
    with torch.no_grad():
        logps = sequence_logps(model, collate_pairs(encoded, list(range(len(pairs))), tokenizer.pad_token_id, 1.0,
                                                    False)).sums
    answers = generate(model, tokenizer, [{"prompt": p["prompt"], "completion": p["chosen"]} for p in pairs])
    return {"wins": float((logps[:, 0] > logps[:, 1]).float().mean()),
            "styled": sum(a["output"].rstrip().endswith(STYLE) for a in answers) / len(answers),
            "exact": sum(a["output"] == a["expected"] for a in answers) / len(answers), "examples": answers}


def _sft_demo(sft: Path, as_json: bool) -> None:
    """No SFT run to start from: the SFT demo, shorter."""
    from rocktune.demo.run import run_demo

    if not as_json:
        print(f"no SFT demo run in {sft}: training one first ({SFT_STEPS} steps)", file=sys.stderr)
    with contextlib.redirect_stdout(io.StringIO()):  # its JSON line is not this demo's
        run_demo(str(sft), True, SFT_STEPS)


def _print_summary(fig: dict, before: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(title=f"rocktune demo --task dpo: the SFT demo's model taught to prefer answers ending in {STYLE!r}")
    table.add_column("held-out pairs")
    table.add_column("before (SFT)", justify="right")
    table.add_column("after (DPO)", justify="right")
    table.add_row("preferred answer more likely", f"{fig['preferred_wins_before']:.0%}",
                  f"{fig['preferred_wins_after']:.0%}")
    table.add_row(f"greedy answers ending in {STYLE!r}", f"{fig['styled_answers_before']:.0%}",
                  f"{fig['styled_answers_after']:.0%}")
    table.add_row("greedy answers exactly the preferred one", f"{fig['exact_preferred_before']:.0%}",
                  f"{fig['exact_preferred_after']:.0%}")
    table.add_row("eval DPO loss", f"{fig['eval_loss_before']:.4f}", f"{fig['eval_loss_after']:.4f}")
    console.print(table)
    for b, a in zip(before, fig["examples"]):
        console.print(f"  {a['prompt']} before {b['output']!r:<10} after {a['output']!r}", markup=False)
    console.print(f"training: {fig['train_seconds']} s ({fig['steps']} steps); adapter: {fig['run_dir']}/adapter")
    console.print(f"report: {fig['report']}" if fig["report"] else
                  "report: not written (pip install 'rocktune[report]' for plots and an HTML page of the run)")


def demo(args) -> int:
    """``rocktune demo --task dpo`` (its registry ``demo`` hook): the SFT demo's model taught to prefer one style."""
    return run_dpo_demo(out_dir=args.out or "runs/demo-dpo", sft_dir=args.sft_dir, as_json=args.json,
                        steps=args.steps, overwrite=args.overwrite)
