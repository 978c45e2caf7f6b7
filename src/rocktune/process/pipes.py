"""A closed pipe on stdout or stderr (``rocktune train ... | head -3``) is not a crash: the output is dropped and the
run goes on. Python ignores SIGPIPE, so a write to a closed pipe raises BrokenPipeError wherever it happens (a
progress line, a summary, a traceback) and, unguarded, ended the child with exit 1, which the supervisor then
recorded as a crash and restarted.

``guard_std_streams`` wraps ``sys.stdout``/``sys.stderr``: at the first EPIPE the stream's file descriptor is pointed
at the null device (so C code writing to it, and Python's final flush at exit, are quiet too) and writing goes on.
"""

from __future__ import annotations

import errno
import os
import sys


class _PipeSafe:
    """A text stream that turns a closed pipe into the null device; everything else is the wrapped stream's."""

    def __init__(self, stream):
        self._stream = stream
        self._closed_pipe = False

    def write(self, text):
        try:
            return self._stream.write(text)
        except OSError as exc:
            self._on_error(exc)
            return len(text)

    def flush(self):
        try:
            self._stream.flush()
        except OSError as exc:
            self._on_error(exc)

    def _on_error(self, exc: OSError) -> None:
        if not isinstance(exc, BrokenPipeError) and exc.errno != errno.EPIPE:
            raise exc
        if not self._closed_pipe:
            self._closed_pipe = True
            null = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(null, self._stream.fileno())  # what is still buffered now drains into the null device
            finally:
                os.close(null)
        try:
            self._stream.flush()
        except OSError:
            pass  # the buffer held the lost text: it is dropped, as everything after it

    def __getattr__(self, name):  # isatty, fileno, encoding, buffer...: the wrapped stream's
        return getattr(self._stream, name)


def guard_std_streams() -> None:
    """Idempotent; call it before the first output (the logging handlers keep the stream they find)."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, _PipeSafe):
            setattr(sys, name, _PipeSafe(stream))
