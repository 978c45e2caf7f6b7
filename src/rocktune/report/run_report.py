"""``rocktune report RUN_DIR [RUN_DIR ...]``: one self-contained HTML page and the plots as PNG files.

One run: ``RUN_DIR/report.html`` and ``RUN_DIR/report_plots/*.png``. Several runs: their curves overlaid and the
config keys in which they differ, in ``compare.html`` (or ``--out``).
"""

from __future__ import annotations

import html
import statistics
import sys
from pathlib import Path

import yaml

from rocktune.atomic import write_atomic
from rocktune.report import page, plots
from rocktune.report.rundata import RunData, load_run
from rocktune import task_registry

# run_info.json's data keys as a person reads them; a key not listed is shown as it is
DATA_LABELS = {"shape": "record shape", "n_records": "records read", "n_truncated": "examples cut to max_length",
               "n_dropped": "examples dropped (nothing left to train)", "cache_hit": "token cache",
               "fingerprint": "data fingerprint", "n_prompt_cut": "examples cut in the prompt",
               "n_completion_cut": "examples cut in the completion", "n_train": "train examples",
               "n_eval": "eval examples", "train_tokens": "train tokens",
               "max_example_tokens": "longest example (tokens)",
               "task": "task", "buckets": "examples per size bucket", "transformer": "transformer trained",
               "flow_shift": "flow shift", "timestep_sampling": "timestep sampling"}
PLOT_TITLES = {"loss": "Train and eval loss", "lr": "Learning rate", "grad_norm": "Gradient norm",
               "tokens_per_s": "Throughput", "memory": "Device memory",
               "memory_over_steps": "Memory over the run",
               "kl": "KL to the reference", "completion_length": "Completion length",
               "clip_ratio": "Clipped ratio", "expert_load": "Expert load (mixture of experts)",
               "router_aux_loss": "Router balance"}


def run_report(run_dirs: list[str], out: str | None = None) -> int:
    runs = [load_run(d) for d in run_dirs]  # every run read (and refused) before anything is written
    path = write_report(runs, Path(out) if out else None)
    for line in skipped_lines(runs):
        print(f"note: {line}", file=sys.stderr)
    print(f"report: {path}")
    return 0


def skipped_lines(runs: list[RunData], shown: int = 20) -> list[str]:
    """One note per file with lines left out (a crash's cut last line, garbage): which lines, so the reader knows
    the curves miss them; long lists are cut to ``shown`` line numbers."""
    by_file: dict[str, list[str]] = {}
    for run in runs:
        for file, line, why in run.skipped_lines:
            by_file.setdefault(file, []).append(f"{line} ({why})")
    notes = []
    for file, lines in by_file.items():
        more = f" and {len(lines) - shown} more" if len(lines) > shown else ""
        notes.append(f"{file}: skipped line{'s' if len(lines) > 1 else ''} {', '.join(lines[:shown])}{more}")
    return notes


def write_report(runs: list[RunData], out: Path | None = None) -> Path:
    """Write the PNGs, then the page (last, so a page on disk always has its plots); return the page's path."""
    out = out or (runs[0].path / "report.html" if len(runs) == 1 else Path("compare.html"))
    images = plots.all_plots(runs)
    for name, png in images.items():
        write_atomic(out.with_name(out.stem + "_plots") / f"{name}.png", png)
    write_atomic(out, report_html(runs, images))
    return out


def report_html(runs: list[RunData], images: dict[str, bytes]) -> str:
    title = f"rocktune run {runs[0].name}" if len(runs) == 1 else "rocktune runs: " + ", ".join(r.name for r in runs)
    body = ["<h2>Summary</h2>", _summary(runs)]
    titles = PLOT_TITLES | {name: title for name, (title, _) in plots.task_plots(runs).items()} if images else {}
    for name, png in images.items():
        body += [f"<h2>{page.esc(titles[name])}</h2>", page.image(png, titles[name])]
    body.append(_events(runs))
    if skipped_lines(runs):
        body += ["<h2>Lines skipped</h2>", "".join(f"<p>{page.esc(n)}</p>" for n in skipped_lines(runs))]
    if len(runs) > 1:
        body += ["<h2>Config differences</h2>", _config_diff(runs)]
        return page.document(title, body)
    run = runs[0]
    body += [_samples(run), _data(run), _platform(run), "<h2>Resolved config</h2>",
             f"<pre>{page.esc(yaml.safe_dump(_own_sections(run.config), sort_keys=False))}</pre>"]
    return page.document(title, body)


def _fmt(x, spec: str = ".4f") -> str:
    return "-" if x is None else format(x, spec)


def summary_row(run: RunData) -> dict[str, str]:
    _, losses = run.series("loss")
    evals = [r["eval_loss"] for r in run.evals if r.get("eval_loss") is not None]
    _, tps = run.series("useful_tokens_per_s", skip_compiling=True)
    _, mem = run.series("peak_mem_bytes", plots.GIB)
    _, secs = run.series("step_s")
    predicted = run.predicted_peak()
    hook = plots.report_hooks(run.config.get("task")).summary  # the task's own lines (task_registry.py)
    own = task_registry.load(hook)(run) if hook else {}
    return {
        "run": run.name, "steps": str(run.steps[-1]["step"] if run.steps else 0),
        "final train loss": _fmt(losses[-1] if losses else None),
        "eval loss (first → last)": f"{_fmt(evals[0] if evals else None)} → {_fmt(evals[-1] if evals else None)}",
        **own,
        "useful tokens/s (median)": _fmt(statistics.median(tps) if tps else None, ",.0f"),
        # medians: with training.log_every > 1 the logged steps are a sample, so a sum would undercount
        "step time (median)": f"{_fmt(statistics.median(secs) if secs else None, '.3f')} s",
        "peak memory (measured / planned)": _memory(run, mem, predicted),
        "checkpoints": ", ".join(map(str, run.checkpoints)) or "-",
        "restarts / skipped / OOM splits": f"{len(run.incidents)} / {len(run.skipped_steps())} / "
                                           f"{len(run.oom_splits())}",
    }


def _memory(run: RunData, mem: list[float], predicted: int | None) -> str:
    if mem or predicted:
        return (f"{_fmt(max(mem) if mem else None, '.2f')} / "
                f"{_fmt(predicted * plots.GIB if predicted else None, '.2f')} GiB")
    rss = max((r.get("peak_rss_bytes") or 0 for r in run.evals), default=0)  # a CPU run's, at its end
    return f"{rss * plots.GIB:.2f} GiB process RSS (CPU run)" if rss else "not recorded"


def _summary(runs: list[RunData]) -> str:
    rows = [summary_row(r) for r in runs]
    if len(runs) == 1:
        return page.table(list(rows[0].items()))
    return page.table([tuple(r.values()) for r in rows], tuple(rows[0]))


def _events(runs: list[RunData]) -> str:
    rows = []
    for run in runs:
        rows += [(run.name, i.get("last_logged_step"), "restart after crash", f"{i.get('cause')}; restart "
                  f"{i.get('restart')}/{i.get('max_restarts')}") for i in run.incidents]
        rows += [(run.name, s, "update skipped", "non-finite loss or gradient") for s in run.skipped_steps()]
        rows += [(run.name, s, "OOM split", f"micro-batches split in {p}") for s, p in run.oom_splits()]
        rows += [(run.name, w.get("step"), "warning", str(text)) for w in run.warnings for text in w["warnings"]]
    if not rows:
        return "<h2>Incidents</h2><p>None: no restart, no skipped update, no OOM split.</p>"
    return "<h2>Incidents</h2>" + page.table(sorted(rows, key=lambda r: (r[0], r[1] or 0)),
                                             ("run", "step", "event", "detail"))


def _samples(run: RunData) -> str:
    hooks = plots.report_hooks(run.config.get("task"))  # the task's own (task_registry.py)
    own = task_registry.load(hooks.samples)(run) if hooks.samples else ""
    if own:
        return own
    steps = run.sample_steps()
    note = hooks.no_samples
    if not steps and note:
        return note.format(run=html.escape(str(run.path)))
    if not steps:
        return "<h2>Samples</h2><p>No samples (set training.sample_count or training.sample_prompts).</p>"
    first, last = steps[0], steps[-1]
    before = {s["prompt"]: s["output"] for s in run.samples if s["step"] == first}
    # A chat prompt is shown by its user's turn (samples.py keeps it as "user"), not the template's text
    rows = [(s.get("user", s["prompt"]), before.get(s["prompt"], ""), s["output"], s.get("expected") or "")
            for s in run.samples if s["step"] == last]
    return (f"<h2>Samples</h2><p>Greedy completions of fixed prompts at step {first} and step {last} "
            f"(all {len(steps)} eval points are in samples.jsonl).</p>"
            + page.table(rows, ("prompt", f"step {first}", f"step {last}", "expected")))


def _data(run: RunData) -> str:
    data = run.info.get("data")
    if not data:
        return ""
    rows = [(DATA_LABELS.get(k, k), _data_value(k, v)) for k, v in data.items()]
    return "<h2>Data</h2>" + page.table(rows)


def _data_value(key: str, value):
    if key == "cache_hit":
        return "reused (hit)" if value else "written by this run"
    if isinstance(value, dict):
        return ", ".join(f"{k}: {v}" for k, v in value.items())
    return value


def _own_sections(config: dict) -> dict:
    """The config without the sections of the other kind of task (an LM run has no use for ``diffusion:``)."""
    task, sections = config.get("task", "lm"), task_registry.sections()  # config sections only some tasks read
    return {k: v for k, v in config.items() if k not in sections or task in sections[k][1]}


def _platform(run: RunData) -> str:
    info = run.info
    if not info:
        return ""
    rows = [("device", info.get("device")), ("precision", info.get("precision"))]
    rows += list(info.get("platform", {}).items())
    notes = "".join(f"<li>{page.esc(n)}</li>" for n in info.get("notes", []))
    return "<h2>Platform and advice applied</h2>" + page.table(rows) + (f"<ul>{notes}</ul>" if notes else "")


def _flatten(d: dict, prefix: str = "") -> dict[str, object]:
    out = {}
    for k, v in d.items():
        out.update(_flatten(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def _config_diff(runs: list[RunData]) -> str:
    flat = [_flatten(r.config) for r in runs]
    keys = sorted({k for f in flat for k in f if len({repr(g.get(k)) for g in flat}) > 1})
    if not keys:
        return "<p>The runs' configs are identical.</p>"
    return page.table([(k, *(str(f.get(k)) for f in flat)) for k in keys], ("key", *(r.name for r in runs)))
