"""What torch.compile did in one benchmark configuration's process: graph breaks, recompiles and graphs.

A compiled decoder that breaks into many graphs, or recompiles as shapes change, launches more kernels and
compiles again where one graph would do; the bench records these beside the speed (and beside the device's own
account of the step, ``device_time.py``) instead of leaving them to a separate trace. Graph breaks and
compiled frames come from Dynamo's own counters; recompiles from its ``recompiles`` log artifact, whose records
name the guard that failed.
"""

from __future__ import annotations

import logging
from collections import Counter

RECOMPILES_LOGGER = "torch._dynamo.guards.__recompiles"
TOP = 3  # the most frequent reasons kept in the report; the counts cover all


class _Recompiles(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.reasons: Counter = Counter()

    def emit(self, record: logging.LogRecord) -> None:
        # One record per recompile: "Recompiling function f in file:line", then the failed guards.
        lines = record.getMessage().splitlines()
        guard = next((x.strip().removeprefix("- ") for x in lines if x.strip().startswith("- ")), None)
        self.reasons[_first_line(guard or (lines[0] if lines else "?"))] += 1


class CompilerRecord:
    """Start before the run, ``report()`` after it (what Dynamo did in between); both are no-ops where torch has no
    Dynamo."""

    def __init__(self) -> None:
        self._handler = _Recompiles()
        self._before: dict[str, Counter] = {}

    def start(self) -> CompilerRecord:
        try:
            import torch._dynamo.utils
            import torch._logging
        except ImportError:
            return self
        # Dynamo's counters are process-wide and never reset: what this record reports is what happens after now.
        self._before = {k: Counter(torch._dynamo.utils.counters[k]) for k in ("graph_break", "frames", "stats")}
        torch._logging.set_logs(recompiles=True)  # the artifact is off by default: nothing would be emitted
        logger = logging.getLogger(RECOMPILES_LOGGER)
        logger.addHandler(self._handler)
        logger.propagate = False  # counted here, not printed once per recompile into the bench's output
        return self

    def report(self) -> dict:
        try:
            from torch._dynamo.utils import counters
        except ImportError:
            return {}
        since = {k: Counter(counters[k]) - self._before.get(k, Counter()) for k in ("graph_break", "frames", "stats")}
        breaks: Counter = Counter()
        for reason, n in since["graph_break"].items():
            breaks[_first_line(reason)] += n
        return {"graph_breaks": sum(breaks.values()), "graph_break_reasons": dict(breaks.most_common(TOP)),
                "recompiles": sum(self._handler.reasons.values()),
                "recompile_reasons": dict(self._handler.reasons.most_common(TOP)),
                "frames_compiled": since["frames"].get("total", 0), "graphs": since["stats"].get("unique_graphs", 0)}


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0][:200] if text and text.strip() else "?"
