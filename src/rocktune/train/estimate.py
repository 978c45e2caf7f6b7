"""What is left of a run, from the steps and evals timed so far, and what its memory says about the machine.

The estimate counts the steps left at the recent steps' pace (a compiling step is left out: it is no step's pace)
and the evals left at the last eval's length, so a run with long evals is not promised early. The memory note puts
the run's peak beside the machine's memory and, when it takes most of it, names the settings that would lower it
and the ``rocktune plan`` command that breaks it down.
"""

from __future__ import annotations

import os
from collections import deque
from dataclasses import dataclass, field

HIGH_SHARE = 0.5  # a peak past half the machine's memory leaves little for the rest: say what lowers it
RECENT = 10  # the steps the pace is taken over: recent enough to follow a slowdown, enough to smooth one slow step


def duration(seconds: float) -> str:
    s = round(seconds)
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


@dataclass
class Estimate:
    total: int  # the run's last step
    eval_every: int  # training.eval_every (0: the final eval only)
    done: int = 0  # the last step finished
    eval_s: float | None = None  # the last eval's length
    _steps: deque = field(default_factory=lambda: deque(maxlen=RECENT))

    def stepped(self, step: int, seconds: float, compiling: bool) -> None:
        self.done = step
        if not compiling:
            self._steps.append(seconds)

    def evaluated(self, seconds: float) -> None:
        self.eval_s = seconds

    def evals_left(self) -> int:
        """The evals after step ``done``: every eval_every steps before the last, and the final one."""
        between = 0
        if self.eval_every:
            between = max(0, (self.total - 1) // self.eval_every - self.done // self.eval_every)
        return between + (1 if self.done < self.total else 0)

    def left_s(self) -> float | None:
        """Seconds left, or None until a step was timed."""
        if not self._steps:
            return None
        pace = sum(self._steps) / len(self._steps)
        return (self.total - self.done) * pace + self.evals_left() * (self.eval_s or 0.0)

    def left_text(self, running: float = 0.0) -> str:
        """``running``: seconds already spent in a step the estimate still counts."""
        left = self.left_s()
        return "" if left is None else f"; about {duration(max(0.0, left - running))} left"

    def first_line(self) -> str:
        """Said once, when the first step was timed: the pace and the run's time left."""
        pace = sum(self._steps) / len(self._steps)
        evals = self.evals_left()
        with_evals = f" and {evals} eval{'s' if evals != 1 else ''}" if evals and self.eval_s else ""
        steps = self.total - self.done
        return (f"estimate: {duration(pace)} a step; about {duration(self.left_s() or 0.0)} left for "
                f"{steps} step{'s' if steps != 1 else ''}{with_evals}")


@dataclass(frozen=True)
class MemoryFacts:
    """What the memory note says: the run's peak, the machine's memory, and the settings that size the peak."""
    peak: int  # bytes: the device's peak on a GPU, the process's peak RSS on a CPU
    machine: int | None  # the device's memory on a GPU, the machine's RAM on a CPU (None: unknown)
    gpu: bool
    model: str
    checkpointing: bool
    micro_batch: int
    max_length: int | None  # None: the task has no data.max_length
    precision: str


def memory_note(f: MemoryFacts) -> str:
    what = "device peak" if f.gpu else "peak RSS"
    line = f"memory: {what} {f.peak / 2**30:.2f} GiB"
    if not f.machine:
        return line
    share = f.peak / f.machine
    line += f", {share:.0%} of this {'device' if f.gpu else 'machine'}'s {f.machine / 2**30:.1f} GiB"
    if share < HIGH_SHARE:
        return line
    lower = ["model.gradient_checkpointing=true (off now: every layer's activations are kept for the backward)"] \
        if not f.checkpointing else []
    if f.micro_batch > 1:
        lower.append(f"a smaller training.micro_batch_size (now {f.micro_batch}; grad_accum keeps the batch)")
    if f.max_length is None:  # a task without token sequences (the planner's LM figures do not apply)
        return f"{line}; to lower it: {'; '.join(lower) or 'a smaller training.micro_batch_size'}"
    lower.append(f"a shorter data.max_length (now {f.max_length}) if the examples allow it")
    plan = (f"rocktune plan {f.model} --max-length {f.max_length} --batch {f.micro_batch} --precision {f.precision}"
            f"{' --vram ' + str(round(f.machine / 2**30)) + 'GiB' if not f.gpu else ''}")
    return (f"{line}; to lower it: {'; '.join(lower)}. `{plan}` breaks the peak down and lists settings that fit; "
            "`rocktune train --auto` applies the planner's choice")


def machine_memory() -> int | None:
    """This machine's RAM in bytes (None where the platform does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # Windows has no sysconf
        return None
