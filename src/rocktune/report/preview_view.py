"""``rocktune data preview``: the preview (data/preview.py) shown in a terminal with rich colours, or written as one
HTML page (``--html``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from rocktune.atomic import write_atomic
from rocktune.report import page
from rocktune.data.preview import Preview, build_preview, histogram

BAR = 40
OPEN, CLOSE = "⟦", "⟧"  # trained tokens, where colours cannot be shown
TEXT_END = (" (ends each document; the rule that it must carry loss is for answers, where a model must learn to "
            "stop, not for text)")


def _shown(chunk: str, trained: bool) -> str:
    """A trained newline is drawn (↵): a highlighted line break is otherwise invisible."""
    return chunk.replace("\n", "↵\n") if trained else chunk


def _summary(pv: Preview) -> list[tuple[str, str]]:
    s = pv.length_stats()
    text = pv.shape == "text"
    return [
        ("data", pv.source or pv.data_file), ("shape", pv.shape),
        ("documents" if text else "records", f"{pv.n_records}"),
        ("kept for training", f"{pv.n_windows} windows" if text else f"{pv.n_kept}"),
        ("truncated", f"{pv.n_truncated} (longer than data.max_length={pv.max_length})"),
        ("dropped", f"{pv.n_dropped} (no loss-bearing token left after truncation, or data.lossy_truncation=drop)"),
        *(("", note) for note in pv.truncation_notes),
        ("tokens per window" if text else "tokens per example",
         f"min {s['min']}, median {s['median']:g}, mean {s['mean']:.1f}, p95 {s['p95']}, max {s['max']}"),
        *_uncut(pv),
        ("loss-bearing tokens", f"{pv.loss_tokens:,} of {pv.total_tokens:,} ({pv.loss_share:.1%})"),
        ("trained on prompts", "yes" if pv.train_on_prompt else "no (completions / assistant turns only)"),
        ("end token", (" / ".join(pv.stop_tokens) or "none") + (TEXT_END if text else "")),
        ("tokenised", f"{pv.records_per_s:,.0f} records/s"),
        ("token cache", f"{pv.cache_bytes / 2**20:,.1f} MiB"),
    ]


def _uncut(pv: Preview) -> list[tuple[str, str]]:
    """The lengths before the cut, where a cut happened, and the max_length that keeps whole the examples whose
    cut removes their system prompt, tool list or answer (issue 55: the cut lengths alone hid it)."""
    u = pv.uncut
    if not u or not u["over"]:
        return []
    rows = [("before the cut", f"min {u['min']}, median {u['median']:g}, p95 {u['p95']}, max {u['max']}; "
             f"{u['over']} longer than data.max_length={pv.max_length}")]
    if pv.needed:
        rows.append(("keeps them whole", f"data.max_length={pv.needed} (the examples whose cut removes their "
                     "system prompt, tool list or part of their last answer)"))
    return rows


def print_preview(pv: Preview) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console(highlight=False)
    table = Table(title="rocktune data preview", show_header=False)
    for key, value in _summary(pv):
        table.add_row(key, escape(value))
    console.print(table)
    console.print("[bold]tokens per example[/]")
    bins = histogram(pv.lengths)
    top = max((b["count"] for b in bins), default=1) or 1
    for b in bins:
        console.print(f"  {b['from']:>6}-{b['to']:<6} {'█' * round(BAR * b['count'] / top):<{BAR}} {b['count']}")
    for ex in pv.examples:
        head = f"\n[bold]{escape(ex['loc'])}[/]" + ("  [yellow](truncated)[/]" if ex["truncated"] else "")
        if console.color_system is not None:
            console.print(head + "   [on dark_green] trained [/] [dim]not trained[/] [bold reverse] special [/]")
            console.print(_styled(ex["runs"]))
        else:  # colours are dropped when the output is a file or a pipe: the marks must be in the text itself
            console.print(head + f"   {escape(OPEN)}trained{escape(CLOSE)} not trained")
            console.print(plain_runs(ex["runs"]), markup=False, soft_wrap=True)
    _print_problems(console, pv.problems)


def _styled(runs: list[list]):
    from rich.text import Text

    text = Text()
    for chunk, trained, special in runs:
        style = ("bold reverse " if special else "") + ("on dark_green" if trained else "dim")
        text.append(_shown(chunk, trained), style=style)
    return text


def plain_runs(runs: list[list]) -> str:
    """The example as plain text, each stretch of trained tokens between ``OPEN`` and ``CLOSE``."""
    out, inside = [], False
    for chunk, trained, _ in runs:
        if trained != inside:
            out.append(OPEN if trained else CLOSE)
            inside = trained
        out.append(chunk)
    return "".join(out) + (CLOSE if inside else "")


def _print_problems(console, problems: list[dict]) -> None:
    from rich.markup import escape

    console.print()
    if not problems:
        console.print("[green]checks passed[/]: loss-bearing tokens present, prompts masked, the end token trained")
    for p in problems:
        colour = "red" if p["level"] == "error" else "yellow"
        console.print(f"[bold {colour}]{p['level']}[/] [{colour}]{escape(p['message'])}[/]")
    if any(p["level"] == "error" for p in problems):
        console.print("[red]rocktune train would stop on the error(s) above.[/]")


def example_html(ex: dict) -> str:
    spans = []
    for chunk, trained, special in ex["runs"]:
        cls = ("trained" if trained else "prompt") + (" special" if special else "")
        spans.append(f"<span class=\"{cls}\">{page.esc(_shown(chunk, trained))}</span>")
    note = " (truncated)" if ex["truncated"] else ""
    return f"<h3>{page.esc(ex['loc'])}{note}</h3><div class=\"tok\">{''.join(spans)}</div>"


def preview_html(pv: Preview) -> str:
    bins = histogram(pv.lengths)
    body = ["<h2>Summary</h2>", page.table(_summary(pv)),
            "<h2>Tokens per example</h2>", page.table([(f"{b['from']}-{b['to']}", b["count"]) for b in bins],
                                                      ("tokens", "examples")),
            "<h2>Checks</h2>"]
    body += [f"<p class=\"{p['level']}\"><b>{p['level']}</b>: {page.esc(p['message'])}</p>" for p in pv.problems]
    if not pv.problems:
        body.append("<p>All checks passed.</p>")
    body.append("<h2>Examples</h2><p><span class=\"trained\">green: carries loss</span>, "
                "<span class=\"prompt\">grey: not trained</span>, <span class=\"special\">boxed: special token</span>"
                "</p>")
    body += [example_html(ex) for ex in pv.examples]
    return page.document(f"rocktune data preview — {pv.data_file}", body)


def run_preview(data, model: str, trust_remote_code: bool, n_show: int, html: str | None, as_json: bool) -> int:
    """Print (or write) the preview of the ``data:`` config section ``data``; exit status 1 when a check would stop
    ``train``."""
    from rocktune.models.load import load_tokenizer

    from rocktune.readers.template import use_template

    tokenizer = use_template(load_tokenizer(model, trust_remote_code), data.chat_template)
    pv = build_preview(data.train_file, data.format, tokenizer, data.max_length, data.train_on_prompt, n_show,
                       data.truncation, data)
    if as_json:
        sys.stdout.write(json.dumps(pv.to_json()) + "\n")
    else:
        print_preview(pv)
    if html:
        write_atomic(Path(html), preview_html(pv))
        if not as_json:
            print(f"preview page: {html}")
    return 1 if any(p["level"] == "error" for p in pv.problems) else 0


def run_config_preview(cfg, n_show: int, as_json: bool, html: str | None = None) -> int:
    """``data preview -c CONFIG`` of a causal-LM task (the registry's default ``preview`` hook): the whole data
    section (columns, split, subset, revision, num_proc open the source as train does), token by token."""
    return run_preview(cfg.data, model=cfg.model.name_or_path, trust_remote_code=cfg.model.trust_remote_code,
                       n_show=n_show, html=html, as_json=as_json)
