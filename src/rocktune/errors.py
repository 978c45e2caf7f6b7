"""The one exception type for bad user input.

Anything raised as ``UserError`` is the user's to fix: the CLI prints its message as one paragraph and exits
with status 2, without a traceback (unless ``--debug``). Everything else is a bug or a machine fault.
"""


class UserError(Exception):
    """Bad input: the message says what is wrong, where, and how to fix it."""


def print_error(message: str) -> None:
    """One paragraph on stderr, the way every user-facing failure is shown."""
    from rich.console import Console
    from rich.markup import escape

    # Escaped: messages quote user input (paths, pydantic's [type=...]) that rich would read as markup.
    Console(stderr=True, highlight=False, soft_wrap=True).print(f"[bold red]error:[/] {escape(message)}")


def quiet_libraries() -> None:
    """Library log lines that are not the user's to act on, silenced where rocktune's processes start (the CLI, the
    supervised worker). bitsandbytes' CPU backend warns at import, in every command, that an optional kernels package
    is missing, although its plain CPU path works (and QLoRA's own self-test proves it before training)."""
    import logging

    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)


def first_line(exc: BaseException, limit: int = 200) -> str:
    """An exception in one short line for a message: library errors often run to pages, and some have no text."""
    text = str(exc).strip()
    return text.splitlines()[0][:limit] if text else type(exc).__name__


def one_line(exc: BaseException, limit: int = 300) -> str:
    """``first_line`` with the exception's type in front: for logs and incidents, where the type is the clue."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {first_line(exc, limit)}" if text else type(exc).__name__
