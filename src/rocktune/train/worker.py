"""The supervised child: ``python -m rocktune.train.worker PAYLOAD_JSON``. Maps outcomes to exit codes."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

from rocktune.train.supervisor import EXIT_FATAL, EXIT_INTERRUPTED, EXIT_ROLLBACK, EXIT_USER_ERROR


def main(argv: list[str]) -> int:
    from rocktune.cli import print_error
    from rocktune.config import config_from_dict
    from rocktune.errors import UserError
    from rocktune.train.guards import FatalNumerics, RollbackRequired
    from rocktune.train.loop import train
    from rocktune.train.step import OutOfMemoryAtMinimum

    payload = json.loads(argv[0])
    _stop_when_orphaned()
    try:
        result = train(config_from_dict(payload["config"]), overwrite=payload["overwrite"],
                       resume_run=payload["resume"], resume_force=payload["resume_force"], pieces=payload["pieces"],
                       auto_fit=payload.get("auto_fit", False), vram_bytes=payload.get("vram_bytes"))
    except UserError as exc:
        print_error(str(exc))
        return EXIT_USER_ERROR
    except RollbackRequired as exc:
        print_error(f"{exc}; rolling back to the last checkpoint")
        return EXIT_ROLLBACK
    except (FatalNumerics, OutOfMemoryAtMinimum) as exc:
        print_error(str(exc))
        return EXIT_FATAL
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    return EXIT_INTERRUPTED if result.interrupted else 0


def _stop_when_orphaned() -> None:
    """If the supervisor dies, checkpoint and stop instead of training on unsupervised."""
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(2)
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=watch, daemon=True).start()


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
