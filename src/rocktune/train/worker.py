"""The supervised child: ``python -m rocktune.train.worker PAYLOAD_JSON``. Maps outcomes to exit codes.

``run_in_process`` is also what ``rocktune train --no-supervise`` calls, so both paths report failures alike.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

from rocktune.train.supervisor import EXIT_FATAL, EXIT_INTERRUPTED, EXIT_ROLLBACK, EXIT_USER_ERROR


def run_in_process(payload: dict) -> int:
    try:  # a Ctrl-C can arrive while torch and transformers are still importing
        from rocktune.config import config_from_dict
        from rocktune.errors import UserError, print_error
        from rocktune.train.guards import FatalNumerics, RollbackRequired
        from rocktune.train.loop import train
        from rocktune.train.step import OutOfMemoryAtMinimum
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    try:
        cfg = config_from_dict(payload["config"])
        result = train(cfg, overwrite=payload["overwrite"], resume_run=payload["resume"],
                       resume_force=payload["resume_force"], pieces=payload["pieces"],
                       auto_fit=payload.get("auto_fit", False), vram_bytes=payload.get("vram_bytes"))
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
    return EXIT_INTERRUPTED if result.interrupted else 0


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
    raise SystemExit(run_in_process(json.loads(sys.argv[1])))
