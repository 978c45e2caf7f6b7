"""What every config section is built from: the section base (unknown keys refused, assignment validated) and the
field tag ``only`` that says which tasks a field applies to. Below config.py and every task's own section (the task
sections live in their task's folder and config.py composes them from the registry), so pydantic only."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


def only(*tags: str, harmless: tuple = ()) -> dict:
    """A field's tag: the tasks it applies to, by the tags of task_registry.TASKS (untagged: every task). Set for a
    task it does not apply to, it is refused (``inapplicable``) unless its value is the default or ``harmless``."""
    return {"tasks": list(tags), "harmless": list(harmless)}


class _Section(BaseModel):
    # Unknown keys are typos until proven otherwise; assignment is validated so overrides stay typed.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())


def home(value):
    """``~/...`` as the shell would expand it: a path a user types in YAML or an override is not seen by a shell,
    and an unexpanded one would be taken for a hub id."""
    import os

    return os.path.expanduser(value) if isinstance(value, str) and value.startswith("~") else value
