"""DPO's and ORPO's registry hooks (task_registry.py): the plan of two sequences a pair, the report's loss label."""

from __future__ import annotations

from rocktune.task_registry import ReportHooks

REPORT = ReportHooks(loss_label="loss per preference pair", plots="rocktune.tasks.preference.report.plots:plots",
                     summary="rocktune.tasks.preference.report.plots:summary")


def plan(args) -> int:
    """A preference pair is two sequences in one forward; DPO's reference pass runs without gradients, so its
    activations are freed layer by layer and add no more than the eval pass does."""
    from rocktune.tasks.causal.hooks import plan_causal

    return plan_causal(args, sequences_per_example=2)
