"""``generate --file``: the prompts of a JSONL file, read and rendered before any weight is loaded.

A line is ``{"prompt": ...}`` or ``{"messages": [...]}``, with an optional ``"tools"`` list: messages and tools are
put in the layout the chat templates take as training put them (``data/chat.py``, ``data/toolcalls.py``), and the
tools go through the template, so a tool-calling model is asked with the tools it trained with. A template that
renders the same text with and without the tools would drop them silently: that line is refused, as training
refuses such a record.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rocktune.errors import UserError
from rocktune.export import style as styles


@dataclass(frozen=True)
class Prompt:
    row: dict  # the line as given: written back with the answers
    text: str  # the line as the model is prompted with it (the run's format, tools included)


def read_prompts(path: Path, style: str, tokenizer) -> list[Prompt]:
    """Every line of ``path`` read, checked and rendered in ``style`` (refusals name the file and line)."""
    from rocktune.data.records import read_records

    check_shape(path)
    return [_prompt(rec, loc, style, tokenizer) for loc, rec in read_records(path)]


def check_shape(path: Path) -> None:
    """The file is there and each line has a prompt or messages: checked before the model is even resolved."""
    from rocktune.data.records import read_records

    if not path.is_file():  # read_records' own message speaks of data.train_file, which generate does not read
        what = "is a folder" if path.is_dir() else "does not exist"
        raise UserError(f"generate --file {path} {what}; give a JSONL file of {{\"prompt\": ...}} or "
                        "{\"messages\": [...], \"tools\": [...]} lines.")
    for loc, rec in read_records(path):
        _need_prompt(rec, loc)


def _need_prompt(rec: dict, loc) -> None:
    if not isinstance(rec.get("prompt"), str) and not isinstance(rec.get("messages"), list):
        raise UserError(f"{loc}: each line needs a 'prompt' string or a 'messages' list.")


def _prompt(rec: dict, loc, style: str, tokenizer) -> Prompt:
    from rocktune.data import toolcalls
    from rocktune.data.chat import Where, message

    _need_prompt(rec, loc)
    tools = toolcalls.schemas(rec.get("tools"), loc)
    if tools and style != "chat":
        raise UserError(f"{loc}: the line gives 'tools', which only a chat template can show the model, and this "
                        f"run is prompted as {style} text (its training format; --template {style}). Drop 'tools', "
                        "or pass --template chat if the model was trained on its chat template.")
    if isinstance(rec.get("messages"), list):
        messages = [message(turn, Where(loc, f"messages[{i}]")) for i, turn in enumerate(rec["messages"])]
        toolcalls.link(messages)
    else:
        messages = None
    prompt = rec["prompt"] if messages is None else None
    text = styles.render(style, tokenizer, prompt=prompt, messages=messages, tools=tools)
    if tools and text == styles.render(style, tokenizer, prompt=prompt, messages=messages):
        names = ", ".join(t["function"]["name"] for t in tools)
        raise UserError(f"{loc}: the chat template does not render the line's tools ({names}): the text is the same "
                        "with and without them, so the model would answer without ever seeing them. Generate with "
                        "the template the run trained with (its data.chat_template, read from the run directory), "
                        "or give --base a model whose template renders tools; or drop 'tools' from the line.")
    return Prompt(rec, text)
