"""How the model was prompted in training, so that generation and Ollama prompt it the same way.

A run trained on chat ``messages`` learned the chat template; one trained on prompt/completion or plain text
learned raw text (even when the tokenizer has a template); an alpaca run learned the alpaca frame, or the chat
template where ``data.chat_template`` rendered its records through it (``data.instruct.uses_template``).
"""

from __future__ import annotations

from pathlib import Path

from rocktune import task_registry
from rocktune.readers.json_file import first_record
from rocktune.readers.template import render_chat_template

STYLES = ("auto", "chat", "raw", "alpaca")


def training_style(run_config: dict, tokenizer=None) -> str | None:
    """chat / raw / alpaca from the run's data.format (auto: the first record of its train_file) and
    data.chat_template; None if unknown."""
    from rocktune.data.instruct import uses_template
    from rocktune.errors import UserError

    data = run_config.get("data") or {}
    row = task_registry.TASKS.get(run_config.get("task", "lm"))
    if row and row.style:  # the task's own policy (task_registry.py), e.g. GRPO's prompts
        return task_registry.load(row.style)(run_config)
    fmt = data.get("format", "auto")
    if fmt == "auto":
        fmt = _first_record_shape(data.get("train_file"))
    try:
        if tokenizer is not None and uses_template(data.get("chat_template", "auto"), fmt or "", tokenizer):
            return "chat"
    except UserError:  # always, with a tokenizer that has no template: training refused it, so it is not this run
        return None
    return {"messages": "chat", "prompt_completion": "raw", "text": "raw", "alpaca": "alpaca"}.get(fmt or "")


def _first_record_shape(train_file: str | None) -> str | None:
    from rocktune.data.records import ALIASES, SHAPES
    from rocktune.data.sources import TEXT_SUFFIXES, text_files

    if not train_file:
        return None
    path = Path(train_file)
    if path.suffix.lower() in TEXT_SUFFIXES or (path.is_dir() and text_files(path)):
        return "text"
    first = first_record(train_file)
    if first is None:
        return None
    if any(key in first for key in ALIASES):
        return ALIASES[next(key for key in ALIASES if key in first)]
    return next((shape for shape, keys in SHAPES.items() if all(k in first for k in keys)), None)


def resolve_style(requested: str, run_config: dict, tokenizer) -> str:
    if requested != "auto":
        return requested
    learned = training_style(run_config, tokenizer)
    if learned:
        return learned
    return "chat" if getattr(tokenizer, "chat_template", None) else "raw"


def render(style: str, tokenizer, prompt: str | None = None, messages: list[dict] | None = None,
           tools: list[dict] | None = None) -> str:
    """The text to generate from: the prompt as training formatted it (``tools``: through the chat template)."""
    from rocktune.data.encode import ALPACA_NO_INPUT
    from rocktune.errors import UserError

    if style == "chat":
        if not getattr(tokenizer, "chat_template", None):
            raise UserError("--template chat: this tokenizer has no chat template; use --template raw.")
        msgs = messages if messages is not None else [{"role": "user", "content": prompt}]
        listed = {"tools": tools} if tools else {}
        return render_chat_template(tokenizer, msgs, tokenize=False, add_generation_prompt=True, **listed)
    if prompt is None:
        if style != "raw":
            raise UserError(f"--template {style} takes a prompt, not a conversation.")
        prompt = "".join(m["content"] for m in messages or [])
    return ALPACA_NO_INPUT.format(instruction=prompt) if style == "alpaca" else prompt
