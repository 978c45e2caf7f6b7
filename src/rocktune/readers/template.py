"""Chat templates come from the model's tokenizer files, i.e. from outside. transformers renders them in jinja's
immutable sandbox, which refuses a template that reaches for Python internals (``__class__``, ``__globals__``,
mutating methods) by raising ``SecurityError`` mid-render; that refusal, and any other template failure, becomes
one ``UserError`` naming the file the template came from."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rocktune import builtin_templates
from rocktune.errors import UserError, first_line


def render_chat_template(tokenizer, messages: list[dict], **kwargs: Any):
    """``tokenizer.apply_chat_template(messages, **kwargs)``, its template's failures as a ``UserError``."""
    from jinja2.exceptions import SecurityError, TemplateError

    try:
        return tokenizer.apply_chat_template(messages, **kwargs)
    except SecurityError as exc:
        raise _refused(tokenizer, exc) from None
    except TemplateError as exc:
        raise UserError(f"the chat template in {template_file(tokenizer)} failed to render "
                        f"({type(exc).__name__}: {first_line(exc)}); fix the template, or use the model's original "
                        "tokenizer files.") from None


def check_chat_template(tokenizer) -> None:
    """Render a one-message probe so that a template reaching for internals is refused before any work; a template
    that raises on the probe on purpose (``raise_exception``, e.g. for a missing system turn) is left to the render
    that uses it."""
    from jinja2.exceptions import SecurityError, TemplateError

    if not getattr(tokenizer, "chat_template", None):
        return
    try:
        tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False, add_generation_prompt=True)
    except SecurityError as exc:
        raise _refused(tokenizer, exc) from None
    except TemplateError:
        pass


def _refused(tokenizer, exc: Exception) -> UserError:
    return UserError(f"the chat template in {template_file(tokenizer)} was refused: it reaches for Python internals "
                     f"that a template has no use for ({first_line(exc)}), which is how a crafted template tries to "
                     "run code. Use the model's original tokenizer files, or remove the chat template from that "
                     "file.")


MODES = ("auto", "always", "never")  # data.chat_template's values that keep the tokenizer's own template


def use_template(tokenizer, setting: str | None):
    """``tokenizer`` with the chat template that ``data.chat_template`` names, when it names a ``.jinja`` file
    (training, preview, generate and export all render with it; the Ollama TEMPLATE is chosen from it); the
    tokenizer's own template otherwise. The file is read, and proven to render, here."""
    if not setting or setting in MODES:
        return tokenizer
    if setting == builtin_templates.NAME:
        return _builtin(tokenizer)
    path = Path(setting)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"data.chat_template={setting} cannot be read ({getattr(exc, 'strerror', None) or exc}); "
                        "name a .jinja chat template file (e.g. the chat_template.jinja of a model of the same "
                        "family), or auto.") from None
    tokenizer.chat_template = text
    tokenizer.rocktune_template_file = str(path)  # errors name the file the template came from
    check_chat_template(tokenizer)
    return tokenizer


def _builtin(tokenizer):
    """``tokenizer`` with rocktune's tool-calling template in its own template's turn format
    (``builtin_templates``); refused, with the alternatives, for a format it does not come in."""
    own = getattr(tokenizer, "chat_template", None)
    shape = builtin_templates.shape_of(own if isinstance(own, str) else None)
    if shape is None:
        formats = ", ".join(s.name for s in builtin_templates.SHAPES)
        raise UserError(f"data.chat_template={builtin_templates.NAME}: rocktune's tool-calling template comes in "
                        f"the turn formats {formats}, and the chat template in {template_file(tokenizer)} uses none "
                        "of them; name a .jinja tool-calling template written for this model's turns in "
                        "data.chat_template, or train without tools: data.tools: drop.")
    tokenizer.chat_template = builtin_templates.jinja(shape)
    tokenizer.rocktune_template_file = f"rocktune's {builtin_templates.NAME} template ({shape.name} turns)"
    return tokenizer


def template_file(tokenizer) -> str:
    """Where a tokenizer's chat template was read from: data.chat_template's file, chat_template.jinja or
    tokenizer_config.json of its directory, or the hub id when it came from the hub cache."""
    if getattr(tokenizer, "rocktune_template_file", None):
        return tokenizer.rocktune_template_file
    source = str(getattr(tokenizer, "name_or_path", "") or "")
    folder = Path(source).expanduser()
    if source and folder.is_dir():
        for name in ("chat_template.jinja", "tokenizer_config.json"):
            if (folder / name).is_file():
                return str(folder / name)
        return str(folder)
    return f"the tokenizer files of {source}" if source else "the tokenizer's files"
