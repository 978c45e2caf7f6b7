"""A GRPO run's plot, summary line and samples section: the rollouts' reward, the held-out greedy reward, and the
rollouts with their rewards (rollouts.py)."""

from __future__ import annotations

from rocktune.report.plots import colours, eval_points, events, figure, png
from rocktune.report.rundata import RunData
from rocktune.tasks.grpo.report import rollouts


def plots(runs: list[RunData]) -> dict[str, tuple[str, bytes]]:
    image = reward_plot(runs)
    return {"reward": ("Rollout rewards", image)} if image is not None else {}


def summary(run: RunData) -> dict[str, str]:
    held = [r["eval_reward"] for r in run.eval_stats if "eval_reward" in r]
    return {"held-out reward, greedy (first → last)": f"{held[0]:.3f} → {held[-1]:.3f}"} if held else {}


def samples(run: RunData) -> str:
    return rollouts.section(run.samples) if rollouts.has_rewards(run.samples) else ""


def reward_plot(runs: list[RunData]) -> bytes | None:
    """A GRPO run's mean reward per step (TRL's ``reward``) and each reward function's (``rewards/NAME/mean``), and
    the held-out greedy reward at each eval as markers."""
    data = [(run, run.series("reward")) for run in runs]
    if not any(xs for _, (xs, _) in data):
        return None
    fig, ax = figure("reward of the rollouts (weighted sum; each function dotted)", "reward")
    several = len(runs) > 1
    for (run, (xs, ys)), c in zip(data, colours(len(runs))):
        prefix = f"{run.name}: " if several else ""
        ax.plot(xs, ys, color=c, linewidth=1, label=f"{prefix}reward")
        names = sorted({k for r in run.steps for k in r if k.startswith("rewards/") and k.endswith("/mean")})
        for name in names if len(names) > 1 else []:
            ax.plot(*run.series(name), ":", color=c, linewidth=1, label=f"{prefix}{name.split('/')[1]}")
        ev = [(r["step"], r["eval_reward"]) for r in run.eval_stats if "eval_reward" in r]
        eval_points(ax, ev, c, f"{prefix}held-out (greedy)")
        events(ax, run, c, several)
    ax.legend(fontsize=8)
    return png(fig)
