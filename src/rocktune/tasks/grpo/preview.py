"""``rocktune data preview -c CONFIG`` for task: grpo: each prompt as the rollouts will see it.

The rows go through the same reader and rendering as training (tasks/grpo/prompts.py): the prompt as the data gives it,
its reference answer (what the built-in rewards compare with; none for a prompt-only row) and the generation prompt
rendered (the chat template with its generation prompt for messages; the text with the tokenizer's specials for
plain prompts), which is exactly what the model continues.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from rocktune.data.rows import read_rows
from rocktune.tasks.grpo.prompts import encode_prompt, read_prompt, reference_lengths
from rocktune.tasks.grpo.watch import length_note


def build_prompt_preview(data, tokenizer, n_show: int, max_completion_length: int = 512) -> dict:
    """``data``: the config's data section. Every row is read and rendered (an error names the row); the first
    ``n_show`` prompts are returned, with the reference answers' lengths against ``grpo.max_completion_length``."""
    with tempfile.TemporaryDirectory(prefix="rocktune-preview-") as tmp:
        rows = read_rows(data.train_file, data, Path(tmp) / "cache", "data.train_file")
    shown: list[dict] = []
    lengths, truncated, with_answer, every = [], 0, 0, []
    for where, row in rows:
        read = read_prompt(row, str(where), data.roles)
        prompt = encode_prompt(read, tokenizer, data.max_length, str(where))
        every.append(prompt)
        lengths.append(len(prompt.ids))
        truncated += prompt.truncated
        with_answer += read.answer is not None
        if len(shown) < n_show:
            shown.append({"loc": str(where), "prompt": read.prompt, "answer": read.answer,
                          "fields": sorted(k for k in read.fields if k != "answer"),
                          "rendered": tokenizer.decode(list(prompt.ids)), "tokens": len(prompt.ids),
                          "truncated": prompt.truncated})
    answers = sorted(reference_lengths(every, tokenizer))
    return {"data_file": data.train_file, "n_prompts": len(lengths), "n_with_answer": with_answer,
            "reference_tokens": {"min": answers[0], "median": answers[len(answers) // 2], "max": answers[-1],
                                 "over_max_completion_length": sum(n > max_completion_length for n in answers)}
            if answers else None, "max_completion_length": max_completion_length,
            "completion_note": length_note(answers, max_completion_length),
            "n_truncated": truncated, "max_length": data.max_length,
            "tokens_per_prompt": {"min": min(lengths), "max": max(lengths), "mean": sum(lengths) / len(lengths)},
            "prompts": shown}


def run_prompt_preview(cfg, n_show: int, as_json: bool, html: str | None = None) -> int:
    from rich.console import Console
    from rich.table import Table

    from rocktune.models.load import load_tokenizer

    tokenizer = load_tokenizer(cfg.model.name_or_path, cfg.model.trust_remote_code)
    pv = build_prompt_preview(cfg.data, tokenizer, n_show, cfg.grpo.max_completion_length)
    if as_json:
        print(json.dumps(pv, indent=1))
        return 0
    console = Console()
    lengths = pv["tokens_per_prompt"]
    console.print(f"{pv['data_file']}: {pv['n_prompts']} prompts for task=grpo, {pv['n_with_answer']} with a "
                  f"reference answer; {pv['n_truncated']} cut to data.max_length={pv['max_length']} (their start "
                  f"dropped); tokens per prompt {lengths['min']}-{lengths['max']}, mean {lengths['mean']:.1f}.",
                  markup=False)
    ref = pv["reference_tokens"]
    if ref:
        console.print(f"reference answers (as written): {ref['min']}-{ref['max']} tokens, median {ref['median']}; "
                      f"{ref['over_max_completion_length']} longer than grpo.max_completion_length="
                      f"{pv['max_completion_length']}.", markup=False)
    if pv["completion_note"]:
        console.print(f"warning: {pv['completion_note']}", style="yellow", markup=False)
    for p in pv["prompts"]:
        table = Table(title=f"{p['loc']}{' (cut)' if p['truncated'] else ''}", show_lines=True, show_header=False)
        table.add_column("what")
        table.add_column("value")
        table.add_row("prompt", p["prompt"] if isinstance(p["prompt"], str) else json.dumps(p["prompt"]))
        table.add_row("reference answer", "(none: prompt-only)" if p["answer"] is None else p["answer"])
        if p["fields"]:
            table.add_row("other fields (to the rewards)", ", ".join(p["fields"]))
        table.add_row(f"generation prompt ({p['tokens']} tokens)", p["rendered"])
        console.print(table, markup=False)
    return 0
