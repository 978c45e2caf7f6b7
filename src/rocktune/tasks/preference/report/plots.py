"""A preference run's plots and summary line: TRL's implicit rewards and the reward accuracy."""

from __future__ import annotations

from rocktune.report.plots import colours, eval_points, events, figure, png
from rocktune.report.rundata import RunData


def plots(runs: list[RunData]) -> dict[str, tuple[str, bytes]]:
    drawn = {"rewards": ("Preference rewards", rewards_plot(runs)),
             "accuracy": ("Reward accuracy", accuracy_plot(runs))}
    return {name: (title, image) for name, (title, image) in drawn.items() if image is not None}


def summary(run: RunData) -> dict[str, str]:
    acc = [r["eval_rewards/accuracies"] for r in run.eval_stats if "eval_rewards/accuracies" in r]
    margin = [r["eval_rewards/margins"] for r in run.eval_stats if "eval_rewards/margins" in r]
    if not (acc and margin):
        return {}
    return {"eval reward accuracy / margin (first → last)":
            f"{acc[0]:.3f} / {margin[0]:.4f} → {acc[-1]:.3f} / {margin[-1]:.4f}"}


def rewards_plot(runs: list[RunData]) -> bytes | None:
    """A preference run's implicit rewards (TRL's rewards/chosen, rewards/rejected) per step, and the held-out
    margin at each eval as markers: the chosen answers' reward should pull away from the rejected ones'."""
    data = [(run, {key: run.series(f"rewards/{key}") for key in ("chosen", "rejected", "margins")}) for run in runs]
    if not any(series["margins"][0] for _, series in data):
        return None
    fig, ax = figure("implicit rewards (beta x log-ratio; ORPO: beta x mean log-prob)", "reward")
    several = len(runs) > 1
    for (run, series), c in zip(data, colours(len(runs))):
        prefix = f"{run.name}: " if several else ""
        for key, style in (("chosen", "-"), ("rejected", ":"), ("margins", "--")):
            ax.plot(*series[key], style, color=c, linewidth=1, label=f"{prefix}{key}")
        ev = [(r["step"], r["eval_rewards/margins"]) for r in run.eval_stats if "eval_rewards/margins" in r]
        eval_points(ax, ev, c, f"{prefix}eval margin")
        events(ax, run, c, several)
    ax.legend(fontsize=8)
    return png(fig)


def accuracy_plot(runs: list[RunData]) -> bytes | None:
    """The share of pairs whose chosen answer has the higher reward: train per step, held-out at each eval."""
    data = [(run, run.series("rewards/accuracies")) for run in runs]
    if not any(xs for _, (xs, _) in data):
        return None
    fig, ax = figure("reward accuracy (chosen ranked above rejected)", "share of pairs")
    several = len(runs) > 1
    for (run, (xs, ys)), c in zip(data, colours(len(runs))):
        prefix = f"{run.name}: " if several else ""
        ax.plot(xs, ys, color=c, linewidth=1, label=f"{prefix}train")
        ev = [(r["step"], r["eval_rewards/accuracies"]) for r in run.eval_stats if "eval_rewards/accuracies" in r]
        eval_points(ax, ev, c, f"{prefix}eval")
        events(ax, run, c, several)
    ax.set_ylim(-0.05, 1.05)
    ax.legend(fontsize=8)
    return png(fig)
