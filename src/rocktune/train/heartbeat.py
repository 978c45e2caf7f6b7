"""A console line at least every ``EVERY_S`` seconds, whatever the run is doing: a CPU step can take minutes, the
model load and the tokenising longer, and a silent console looks like a hung one. A daemon thread wakes every few
seconds; when the current phase has gone on for ``EVERY_S`` with nothing said, it says which phase and for how long,
with the estimate of what is left once the first steps were timed (``Estimate``).

The engine sets the phases it knows (start-up, each step, each eval, the final writes); a task may name its own
start-up phases (``phase("tokenising the data")``) without holding the heartbeat. Only rank 0 speaks.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from rocktune.train.estimate import Estimate, duration

_active: Heartbeat | None = None  # the run's heartbeat, for ``phase`` (one run per process)


def phase(name: str) -> None:
    """Name what the run does now (a task's start-up: "loading the model", "tokenising the data")."""
    if _active is not None:
        _active.phase(name)


class Heartbeat:
    EVERY_S = 30.0

    def __init__(self, log: Callable[[str], None], enabled: bool = True, clock: Callable[[], float] = time.monotonic,
                 every_s: float | None = None):
        self.log, self.enabled, self.clock = log, enabled, clock
        self.every = every_s if every_s is not None else self.EVERY_S
        self.estimate: Estimate | None = None  # set once the run knows its steps
        self._lock = threading.Lock()
        self._name, self._since, self._counted = "starting", clock(), False
        self._said = self._since  # when a line last went out: phase changes and heartbeats alike
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def phase(self, name: str, counted: bool = False) -> None:
        """``counted``: the estimate's time left includes this phase (a step), so its time so far comes off it."""
        with self._lock:
            self._name, self._since, self._counted = name, self.clock(), counted

    def said(self) -> None:
        """Something was printed: the next heartbeat is due ``every`` seconds from now."""
        with self._lock:
            self._said = self.clock()

    def due(self) -> str | None:
        """The line to print now, or None: the phase has lasted ``every`` seconds and nothing was said for as long."""
        with self._lock:
            now = self.clock()
            if now - self._since < self.every or now - self._said < self.every:
                return None
            self._said = now
            name, since, counted = self._name, self._since, self._counted
        left = self.estimate.left_text(now - since if counted else 0.0) if self.estimate is not None else ""
        return f"[dim]… {name}: {duration(now - since)} so far{left}[/]"

    def beat(self) -> None:
        line = self.due()
        if line is not None:
            self.log(line)

    def __enter__(self) -> Heartbeat:
        global _active
        _active = self
        if self.enabled:
            self._thread = threading.Thread(target=self._run, name="rocktune-heartbeat", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        global _active
        _active = None
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        tick = min(2.0, self.every / 4)
        while not self._stop.wait(tick):
            try:
                self.beat()
            except Exception:  # noqa: BLE001 -- a console that fails (a closed pipe) must never stop the training
                return
