"""The supervised child: ``python -m rocktune.process.worker REQUEST_JSON``. Maps outcomes to exit statuses.

``run_in_process`` is also what ``rocktune train --no-supervise`` calls, so both paths report failures alike:
a user error is one paragraph (exit 2), a full disk one paragraph (exit 5), running out of memory on any device one
paragraph (exit 7: in a step only after splitting it failed too), an unexpected error a traceback — exit 6
when it came before the first optimizer step (deterministic: the supervisor does not retry it), else 1.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

from rocktune import exits
from rocktune.train.request import RunRequest


def run_in_process(request: RunRequest) -> int:
    try:  # a Ctrl-C can arrive while torch and transformers are still importing
        from rocktune.config import config_from_dict
        from rocktune.errors import UserError, one_line, print_error
        from rocktune.process import outcome
        from rocktune.tasks import train
        from rocktune.train.distributed import DistributedFailure
        from rocktune.train.faults import Faults
        from rocktune.train.guards import FatalNumerics, RollbackRequired
        from rocktune.train.oom import is_out_of_memory
        from rocktune.train.step import OutOfMemoryAtMinimum, OutOfMemoryInGroup
    except KeyboardInterrupt:
        return exits.INTERRUPTED
    # Several ranks: rank 0 reports (the launcher names the first rank that failed); one writer, one file.
    report = outcome.Report(request.status_file if os.environ.get("RANK", "0") == "0" else None)
    try:
        faults = Faults()
        faults.startup()
        cfg = config_from_dict(request.config)
        # The first completed step ends start-up: a failure after it is worth a restart.
        result = train(cfg, request.options, faults=faults, on_step_done=lambda step: report.step_done())
    except UserError as exc:
        print_error(str(exc))
        return exits.USER_ERROR
    except RollbackRequired as exc:
        print_error(f"{exc}; the run continues from its last checkpoint in fp32 (under the supervisor, or by "
                    "rerunning with --resume-force training.precision=fp32)")
        return exits.ROLLBACK
    except FatalNumerics as exc:
        print_error(f"{exc} The last good checkpoint is in {cfg.output.dir}/checkpoints.")
        return exits.FATAL
    except OutOfMemoryAtMinimum as exc:
        print_error(f"{exc} The last good checkpoint is in {cfg.output.dir}/checkpoints.")
        report.failed(f"out of memory: {one_line(exc)}")
        return exits.OUT_OF_MEMORY
    except KeyboardInterrupt:
        return exits.INTERRUPTED
    except DistributedFailure as exc:  # another rank died or hung: said in one paragraph; a restart may help
        print_error(str(exc))
        report.failed(one_line(exc), exc.unanswered)
        return exits.CRASH
    except Exception as exc:  # noqa: BLE001 — mapped to what the supervisor can do about it
        if is_out_of_memory(exc) and not isinstance(exc, OutOfMemoryInGroup):  # a group's OOM is restarted
            return _out_of_memory(exc, report, request)
        return _crashed(exc, report, Path(request.run_dir))
    return exits.INTERRUPTED if result.interrupted else exits.OK


def _out_of_memory(exc: Exception, report, request: RunRequest) -> int:
    """Memory ran out outside a step's split (loading, evaluation, a checkpoint): one paragraph, never a traceback;
    a restart at the same size would meet the same wall."""
    from rocktune.errors import one_line, print_error
    from rocktune.train.oom import describe

    model = request.config.get("model", {}).get("name_or_path", "MODEL")
    print_error(f"out of memory outside a training step ({describe(exc)}). Less memory is needed: lower "
                f"data.max_length or training.micro_batch_size, or see what fits with `rocktune plan --model "
                f"{model}`. Checkpoints written so far are in {Path(request.run_dir) / 'checkpoints'}.")
    report.failed(f"out of memory: {one_line(exc)}")
    return exits.OUT_OF_MEMORY


def _crashed(exc: Exception, report, run_dir: Path) -> int:
    from rocktune.errors import one_line, print_error
    from rocktune.process import outcome
    from rocktune.train import finish
    from rocktune.train.rundir import out_of_space

    if out_of_space(exc):  # wherever it struck: a restart would only fill the same disk again
        if not isinstance(exc, finish.DiskFullError):
            where = run_dir if run_dir.exists() else run_dir.parent
            free = shutil.disk_usage(where).free if where.exists() else 0
            exc = finish.DiskFullError(finish.explain(run_dir, "a file", None, free, exc), one_line(exc))
        print_error(str(exc))
        report.failed(f"disk full: {exc.cause}")
        return exits.DISK_FULL
    traceback.print_exc()
    report.failed(one_line(exc))
    return exits.CRASH if report.stepped or outcome.device_fault(exc) else exits.STARTUP


def _stop_when_orphaned() -> None:
    """If the supervisor dies, checkpoint and stop instead of training on unsupervised (POSIX: the parent changes)."""
    if os.name == "nt":
        return  # no cheap, safe liveness test of the parent there; the supervisor's own Ctrl-C handling remains
    import _thread

    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(2)
        _thread.interrupt_main(signal.SIGINT)

    threading.Thread(target=watch, daemon=True).start()


if __name__ == "__main__":
    from rocktune.process.pipes import guard_std_streams

    guard_std_streams()  # before any output: a closed pipe is not a crash (pipes.py)
    if hasattr(signal, "SIGBREAK"):  # Windows: the supervisor's CTRL_BREAK stops us cleanly until the loop takes over
        signal.signal(signal.SIGBREAK, signal.default_int_handler)
    _stop_when_orphaned()
    from rocktune.errors import quiet_libraries

    quiet_libraries()
    raise SystemExit(run_in_process(RunRequest.from_json(sys.argv[1])))
