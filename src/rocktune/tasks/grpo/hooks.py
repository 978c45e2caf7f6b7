"""GRPO's registry hooks (task_registry.py): the plan with its rollouts, the report's loss label and
export's prompt style."""

from __future__ import annotations

from rocktune.task_registry import ReportHooks

_OWN = "rocktune.tasks.grpo.report.plots"
REPORT = ReportHooks(loss_label="GRPO objective (clipped surrogate + beta KL)", plots=f"{_OWN}:plots",
                     summary=f"{_OWN}:summary", samples=f"{_OWN}:samples")


def plan(args) -> int:
    from rocktune.tasks.causal.hooks import plan_causal

    return plan_causal(args, completion=True)


def style(run_config: dict) -> str | None:
    """Prompts as tasks/grpo/prompts.py reads them: messages rendered through the chat template, text raw."""
    from rocktune.readers.json_file import first_record

    data = run_config.get("data") or {}
    first = first_record(data.get("train_file"))
    columns = data.get("columns") or {}
    if first is None:
        return None
    chat = isinstance(first.get(columns.get("prompt", "prompt")), list) or \
        isinstance(first.get(columns.get("messages", "messages")), list)  # a conversation: its turns are the prompt
    return "chat" if chat else "raw"
