"""``rocktune data preview -c CONFIG`` for task: dpo / orpo: each pair side by side, as training reads it.

The rows go through the same reader, format detection, template and truncation as training (pairs.py),
so the tokens marked trained here are the ones whose log-probabilities the loss compares: the prompt (shared, never
trained) and then the chosen and the rejected answer, each with its trained tokens in brackets.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from rocktune.tasks.preference import signal as pair_signal
from rocktune.data.rows import read_rows
from rocktune.tasks.preference.pairs import encode_kinds
from rocktune.errors import UserError
from rocktune.data.preview import runs


def build_pair_preview(data, tokenizer, n_show: int, no_signal: str = "auto") -> dict:
    """``data``: the config's data section. Every row is read and encoded (an error names the row); the first
    ``n_show`` pairs are returned as runs of ``[text, trained, special]`` per side. Pairs without signal are
    counted by kind with their rows, and judged by ``no_signal`` (preference.no_signal) as training judges them."""
    with tempfile.TemporaryDirectory(prefix="rocktune-preview-") as tmp:
        rows = read_rows(data.train_file, data, Path(tmp) / "cache", "data.train_file")
    special = set(tokenizer.all_special_ids)
    shown: list[dict] = []
    lengths: list[int] = []
    truncated = 0
    encoded = encode_kinds(rows, tokenizer, data.max_length, data.truncation)
    kinds = [(where, k) for (where, _), (_, k) in zip(rows, encoded)]
    for (where, _), (pair, _) in zip(rows, encoded):
        lengths.append(pair.length)
        truncated += pair.truncated
        if len(shown) < n_show:
            shown.append({"loc": str(where), "truncated": pair.truncated,
                          "chosen": runs(*pair.chosen, tokenizer, special),
                          "rejected": runs(*pair.rejected, tokenizer, special),
                          "trained_tokens": [sum(t != -100 for t in side[1][1:]) for side in (pair.chosen,
                                                                                            pair.rejected)]})
    return {"data_file": data.train_file, "n_pairs": len(lengths), "n_truncated": truncated,
            "max_length": data.max_length, "tokens_per_pair": {"min": min(lengths), "max": max(lengths),
                                                               "mean": sum(lengths) / len(lengths)},
            "pairs": shown, "no_signal": pair_signal.summary(kinds),
            "problems": _signal_problems(kinds, no_signal, data.train_file)}


def _signal_problems(kinds, policy: str, name: str) -> list[dict]:
    """What training would say about the pairs without signal: an error where it would stop, else a warning."""
    try:
        _, notes = pair_signal.screen(kinds, policy, name)
    except UserError as exc:
        return [{"level": "error", "code": "no-signal", "message": str(exc)}]
    return [{"level": "warning", "code": "no-signal", "message": n.removeprefix("warning: ")} for n in notes]


def _text(run_list: list) -> str:
    """Trained tokens in [brackets], the rest as they are (what the terminal shows)."""
    return "".join(f"[{text}]" if trained else text for text, trained, _special in run_list)


def run_pair_preview(cfg, n_show: int, as_json: bool, html: str | None = None) -> int:
    from rich.console import Console
    from rich.table import Table

    from rocktune.models.load import load_tokenizer

    from rocktune.readers.template import use_template

    tokenizer = use_template(load_tokenizer(cfg.model.name_or_path, cfg.model.trust_remote_code),
                             cfg.data.chat_template)
    pv = build_pair_preview(cfg.data, tokenizer, n_show, cfg.preference.no_signal)
    failed = int(any(p["level"] == "error" for p in pv["problems"]))
    if as_json:
        print(json.dumps(pv, indent=1))
        return failed
    console = Console()
    lengths = pv["tokens_per_pair"]
    console.print(f"{pv['data_file']}: {pv['n_pairs']} pairs for task={cfg.task}; {pv['n_truncated']} cut to "
                  f"data.max_length={pv['max_length']}; tokens per pair (both sequences) {lengths['min']}-"
                  f"{lengths['max']}, mean {lengths['mean']:.1f}. [brackets]: the answer tokens the loss scores.",
                  markup=False)
    for pair in pv["pairs"]:
        table = Table(title=f"{pair['loc']}{' (cut)' if pair['truncated'] else ''}", show_lines=True)
        c, r = pair["trained_tokens"]
        table.add_column(f"chosen ({c} trained tokens)")
        table.add_column(f"rejected ({r} trained tokens)")
        table.add_row(_text(pair["chosen"]), _text(pair["rejected"]))
        console.print(table, markup=False)
    for problem in pv["problems"]:
        console.print(f"{problem['level']}: {problem['message']}", markup=False)
    if not pv["problems"]:
        console.print("checks passed: every pair has a shared prompt and two different answers.", markup=False)
    return failed
