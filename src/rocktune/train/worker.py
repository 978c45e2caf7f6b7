"""The supervised child: ``python -m rocktune.train.worker PAYLOAD_JSON``. Maps outcomes to exit codes.

``run_in_process`` is also what ``rocktune train --no-supervise`` calls, so both paths report failures alike:
a user error is one paragraph (exit 2), a full disk one paragraph (exit 5), an unexpected error a traceback — exit 6
when it came before the first optimizer step (deterministic: the supervisor does not retry it), else 1.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

from rocktune.train.outcome import EXIT_DISK_FULL, EXIT_STARTUP
from rocktune.train.supervisor import EXIT_FATAL, EXIT_INTERRUPTED, EXIT_ROLLBACK, EXIT_USER_ERROR


def run_in_process(payload: dict) -> int:
    try:  # a Ctrl-C can arrive while torch and transformers are still importing
        from rocktune.config import config_from_dict
        from rocktune.errors import UserError, print_error
        from rocktune.train import outcome
        from rocktune.train.distributed import DistributedFailure
        from rocktune.train.guards import FatalNumerics, RollbackRequired
        from rocktune.train.loop import train
        from rocktune.train.step import OutOfMemoryAtMinimum
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    # Several ranks: rank 0 reports (the launcher names the first rank that failed); one writer, one file.
    report = outcome.Report(payload.get("status_file") if os.environ.get("RANK", "0") == "0" else None)
    try:
        faults = _watched_faults(report)
        faults.startup()
        cfg = config_from_dict(payload["config"])
        if cfg.is_diffusion:  # Wan LoRA: its own loop over the same step, guard and checkpoint code
            from rocktune.train.diffusion_loop import train_diffusion as train
        result = train(cfg, overwrite=payload["overwrite"], resume_run=payload["resume"],
                       resume_force=payload["resume_force"], pieces=payload["pieces"],
                       auto_fit=payload.get("auto_fit", False), vram_bytes=payload.get("vram_bytes"), faults=faults)
    except UserError as exc:
        print_error(str(exc))
        return EXIT_USER_ERROR
    except RollbackRequired as exc:
        print_error(f"{exc}; the run continues from its last checkpoint in fp32 (under the supervisor, or by "
                    "rerunning with --resume-force training.precision=fp32)")
        return EXIT_ROLLBACK
    except (FatalNumerics, OutOfMemoryAtMinimum) as exc:
        print_error(f"{exc} The last good checkpoint is in {cfg.output.dir}/checkpoints.")
        return EXIT_FATAL
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except DistributedFailure as exc:  # another rank died or hung: said in one paragraph; a restart may help
        print_error(str(exc))
        report.failed(outcome.one_line(exc), exc.unanswered)
        return 1
    except Exception as exc:  # noqa: BLE001 — mapped to what the supervisor can do about it
        return _crashed(exc, report, Path(payload["config"]["output"]["dir"]))
    return EXIT_INTERRUPTED if result.interrupted else 0


def _crashed(exc: Exception, report, run_dir: Path) -> int:
    from rocktune.errors import print_error
    from rocktune.train import finish, outcome
    from rocktune.train.rundir import out_of_space

    if out_of_space(exc):  # wherever it struck: a restart would only fill the same disk again
        if not isinstance(exc, finish.DiskFullError):
            where = run_dir if run_dir.exists() else run_dir.parent
            free = shutil.disk_usage(where).free if where.exists() else 0
            exc = finish.DiskFullError(finish.explain(run_dir, "a file", None, free, exc), outcome.one_line(exc))
        print_error(str(exc))
        report.failed(f"disk full: {exc.cause}")
        return EXIT_DISK_FULL
    traceback.print_exc()
    report.failed(outcome.one_line(exc))
    return 1 if report.stepped or outcome.device_fault(exc) else EXIT_STARTUP


def _watched_faults(report):
    """The loop's fault hooks, plus the note to the supervisor that the first optimizer step has completed."""
    from rocktune.train.faults import Faults

    class Watched(Faults):
        def after_update(self, step: int) -> None:
            report.step_done()  # the update is done: a kill right after it is no longer a start-up failure
            super().after_update(step)

    return Watched()


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
    if hasattr(signal, "SIGBREAK"):  # Windows: the supervisor's CTRL_BREAK stops us cleanly until the loop takes over
        signal.signal(signal.SIGBREAK, signal.default_int_handler)
    _stop_when_orphaned()
    from rocktune.errors import quiet_libraries

    quiet_libraries()
    raise SystemExit(run_in_process(json.loads(sys.argv[1])))
