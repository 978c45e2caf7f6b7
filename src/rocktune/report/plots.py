"""The report's plots, drawn by matplotlib (Agg: no display needed) as PNG bytes.

Every plot shares the step axis and marks the run's events on it — checkpoints (grey dotted), restarts after a
crash (red), skipped updates (orange), OOM splits (purple) — so a jump in a curve can be read against what happened.
Several runs overlay, one colour each.
"""

from __future__ import annotations

import io

from rocktune.errors import UserError
from rocktune.report.rundata import RunData
from rocktune import task_registry
from rocktune.task_registry import ReportHooks

GIB = 2**-30


def report_hooks(task: str | None) -> ReportHooks:
    """What the report says differently for a run's task (its registry row's ``report`` hook); the default for a
    task this version does not know."""
    row = task_registry.TASKS.get(task or "lm")
    return task_registry.load(row.report) if row else ReportHooks()


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise UserError("rocktune report draws its plots with matplotlib, which is not installed: "
                        "pip install 'rocktune[report]'.") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    _pyplot().close(fig)
    return buf.getvalue()


def events(ax, run: RunData, colour, several: bool) -> None:
    """Event marks; with several runs only restarts and OOM splits (checkpoints of all runs would be a fence)."""
    first = True
    if not several:
        for step in run.checkpoints:
            ax.axvline(step, color="grey", linestyle=":", linewidth=1, label="checkpoint" if first else None)
            first = False
    for i, (step, _cause) in enumerate(run.incident_steps()):
        ax.axvline(step, color="red", linewidth=1.5, label="restart after crash" if i == 0 else None)
    for i, (step, _pieces) in enumerate(run.oom_splits()):
        ax.axvline(step, color="purple", linestyle="--", linewidth=1,
                   label="OOM: micro-batch split" if i == 0 else None)
    for i, step in enumerate(run.skipped_steps()):
        ax.axvline(step, color="orange", linewidth=1, alpha=.6, label="update skipped" if i == 0 else None)


def figure(title: str, ylabel: str):
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(10, 3.6), layout="constrained")
    ax.set_title(title)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=.3)
    return fig, ax


def colours(n: int) -> list:
    return [f"C{i % 10}" for i in range(n)]


def loss_plot(runs: list[RunData]) -> bytes:
    labels = {report_hooks(run.config.get("task")).loss_label for run in runs}  # the task's (task_registry.py)
    fig, ax = figure("loss", labels.pop() if len(labels) == 1 else ReportHooks().loss_label)
    several = len(runs) > 1
    for run, c in zip(runs, colours(len(runs))):
        prefix = f"{run.name}: " if several else ""
        ax.plot(*run.series("loss"), color=c, linewidth=1, label=f"{prefix}train")
        ev = [(r["step"], r["eval_loss"]) for r in run.evals if r.get("eval_loss") is not None]
        eval_points(ax, ev, c, f"{prefix}eval")
        events(ax, run, c, several)
    ax.legend(fontsize=8)
    return png(fig)


def eval_points(ax, points: list[tuple[int, float]], colour, label: str) -> None:
    """Eval losses as markers; joined by a dashed line only from three points on: two points joined would read as a
    measured trend between them (before and after training, nothing was measured in between)."""
    if points:
        ax.plot(*zip(*points), "o--" if len(points) >= 3 else "o", color=colour, markersize=5, label=label)


def series_plot(runs: list[RunData], key: str, title: str, ylabel: str, scale: float = 1.0,
                skip_compiling: bool = False) -> bytes | None:
    """One metric per step for every run; None when no run logged it."""
    data = [(run, run.series(key, scale, skip_compiling)) for run in runs]
    if not any(xs for _, (xs, _) in data):
        return None
    fig, ax = figure(title, ylabel)
    several = len(runs) > 1
    for (run, (xs, ys)), c in zip(data, colours(len(runs))):
        ax.plot(xs, ys, color=c, linewidth=1, label=run.name if several else key)
        events(ax, run, c, several)
    ax.legend(fontsize=8)
    return png(fig)


def memory_plot(runs: list[RunData]) -> bytes | None:
    """Measured peak device memory per step beside the planner's prediction (a horizontal line)."""
    data = [(run, run.series("peak_mem_bytes", GIB)) for run in runs]
    if not any(xs for _, (xs, _) in data):
        return None
    fig, ax = figure("peak device memory per step", "GiB")
    several = len(runs) > 1
    for (run, (xs, ys)), c in zip(data, colours(len(runs))):
        ax.plot(xs, ys, color=c, linewidth=1, label=f"{run.name}: measured" if several else "measured")
        if run.predicted_peak():
            ax.axhline(run.predicted_peak() * GIB, color=c, linestyle="--",
                       label=f"{run.name}: planner" if several else "planner's prediction")
        events(ax, run, c, several)
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    return png(fig)


HELD = (("rss_bytes", "process RSS", "-"), ("mem_allocated_bytes", "allocated", "-"),
        ("mem_reserved_bytes", "reserved", ":"))


def held_memory_plot(runs: list[RunData]) -> bytes | None:
    """Memory held after each step (the CPU process's RSS; a GPU's allocated and reserved): flat over a long run,
    or creeping up — a leak, or fragmentation when reserved pulls away from allocated."""
    data = [(run, [(label, style, run.series(key, GIB)) for key, label, style in HELD]) for run in runs]
    if not any(xs for _, series in data for _, _, (xs, _) in series):
        return None
    fig, ax = figure("memory held over the run (after each logged step)", "GiB")
    several = len(runs) > 1
    for (run, series), c in zip(data, colours(len(runs))):
        for label, style, (xs, ys) in series:
            if xs:
                ax.plot(xs, ys, style, color=c, linewidth=1, label=f"{run.name}: {label}" if several else label)
        events(ax, run, c, several)
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    return png(fig)


def expert_loads(run: RunData) -> tuple[list[int], list[list[float]]]:
    """(steps, each step's share of the routed tokens per expert) of an MoE run's ``expert_load`` lines; lines whose
    list is not numbers, or not as long as the first one's, are left out."""
    steps, rows = [], []
    for r in run.steps:
        load = r.get("expert_load")
        if not isinstance(load, list) or not load or (rows and len(load) != len(rows[0])) or \
                not all(_number(x) and x >= 0 for x in load) or not sum(load):
            continue
        steps.append(r["step"])
        rows.append([x / sum(load) for x in load])
    return steps, rows


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x and abs(x) != float("inf")


def expert_load_plot(runs: list[RunData]) -> bytes | None:
    """An MoE run's expert load: each expert's share of the step's routed tokens (summed over the MoE layers), a
    row per expert, a column per logged step. A dark row is an expert the router starves; an even shade is
    balance. The first run with the metric is drawn (one heat map per page)."""
    run, (steps, rows) = next(((r, expert_loads(r)) for r in runs if expert_loads(r)[0]), (None, ([], [])))
    if run is None:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(10, 3.6), layout="constrained")
    experts = len(rows[0])
    image = ax.imshow(list(map(list, zip(*rows))), aspect="auto", interpolation="nearest", origin="lower",
                      extent=(steps[0] - 0.5, steps[-1] + 0.5, -0.5, experts - 0.5), cmap="viridis", vmin=0)
    fig.colorbar(image, ax=ax, label="share of routed tokens")
    ax.set_title(f"expert load{f' ({run.name})' if len(runs) > 1 else ''}: even shares are 1/{experts}")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("expert")
    return png(fig)


def task_plots(runs: list[RunData]) -> dict[str, tuple[str, bytes]]:
    """name -> (title, PNG) of the runs' tasks' own plots (their registry rows' ``report.plots`` hooks)."""
    out: dict[str, tuple[str, bytes]] = {}
    for task in dict.fromkeys(run.config.get("task") for run in runs):
        hook = report_hooks(task).plots
        if hook:
            out.update(task_registry.load(hook)(runs))
    return out


def all_plots(runs: list[RunData]) -> dict[str, bytes]:
    """name -> PNG, in the order the report shows them (the tasks' own after the memory plots); plots without data
    are left out."""
    plots = {
        "loss": loss_plot(runs),
        "lr": series_plot(runs, "lr", "learning-rate schedule", "lr"),
        "grad_norm": series_plot(runs, "grad_norm", "gradient norm (before clipping)", "L2 norm"),
        "tokens_per_s": series_plot(runs, "useful_tokens_per_s", "useful (loss-bearing) tokens/s",
                                    "tokens/s", skip_compiling=True),
        "memory": memory_plot(runs),
        "memory_over_steps": held_memory_plot(runs),
        **{name: png for name, (_, png) in task_plots(runs).items()},
        "kl": series_plot(runs, "kl", "KL to the reference (adapter off)", "per-token KL (k3)"),
        "completion_length": series_plot(runs, "completions/mean_length", "mean completion length", "tokens"),
        "clip_ratio": series_plot(runs, "clip_ratio/region_mean", "clipped share of completion tokens", "share"),
        "expert_load": expert_load_plot(runs),
        "router_aux_loss": series_plot(runs, "router_aux_loss", "router load-balancing loss (logged, not trained; "
                                       "even routing gives top-k)", "aux loss"),
    }
    return {k: v for k, v in plots.items() if v is not None}
