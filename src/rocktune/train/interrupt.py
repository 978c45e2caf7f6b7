"""Ctrl-C during training: the one loop (train/loop.py, every task) stops at a step boundary with a checkpoint."""

from __future__ import annotations

import signal
import threading


class InterruptFlag:
    """First Ctrl-C: finish the step, checkpoint, exit cleanly. Second Ctrl-C: stop at once."""

    def __init__(self):
        self.requested = False
        self._previous = None

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    # SIGBREAK is what the supervisor can send a child on Windows (CTRL_BREAK_EVENT).
    SIGNALS = [signal.SIGINT] + ([signal.SIGBREAK] if hasattr(signal, "SIGBREAK") else [])

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._previous = [(s, signal.signal(s, self._handle)) for s in self.SIGNALS]
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous or []:
            signal.signal(sig, handler)
