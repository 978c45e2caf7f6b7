"""``rocktune train --nproc N``: several worker processes through torchrun's launcher (``torch.distributed.run``).

The supervised child is then this launcher instead of one worker: ``python -m rocktune.train.launch PAYLOAD``. It
runs torchrun in-process (``--max-restarts 0``: restarting is the supervisor's job, from the last checkpoint) and
turns torchrun's "a child failed" into the first failing rank's own exit status, so a user error in every rank is
still a user error (exit 2, never retried) and a killed rank is still a crash to restart. It names that rank on
stderr and in ``rank_failure.json`` beside the supervisor's status file, for its incident log.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

FAILURE_FILE = "rank_failure.json"


def is_multi(launch: dict | None) -> bool:
    launch = launch or {}
    return launch.get("nproc", 1) > 1 or launch.get("nnodes", 1) > 1


def torchrun_args(launch: dict) -> list[str]:
    """One node: ``--standalone`` (a free local port). Several: a static master (``--master-addr/--master-port``
    with ``--node-rank``) or a c10d rendezvous endpoint (``--rdzv-endpoint``)."""
    args = ["--nproc-per-node", str(launch.get("nproc", 1)), "--max-restarts", "0"]
    nnodes = launch.get("nnodes", 1)
    if nnodes == 1 and not launch.get("rdzv_endpoint"):
        return args + ["--standalone"]
    args += ["--nnodes", str(nnodes)]
    if launch.get("rdzv_endpoint"):
        return args + ["--rdzv-backend", "c10d", "--rdzv-endpoint", launch["rdzv_endpoint"],
                       "--rdzv-id", launch.get("rdzv_id") or "rocktune"]
    return args + ["--node-rank", str(launch.get("node_rank", 0)), "--master-addr", launch["master_addr"],
                   "--master-port", str(launch.get("master_port", 29500))]


def child_command(payload: dict) -> list[str]:
    module = "rocktune.train.launch" if is_multi(payload.get("launch")) else "rocktune.train.worker"
    return [sys.executable, "-m", module, json.dumps(payload)]


def check_available() -> None:
    """Refuse early, with the way out, where this torch has no torch.distributed (AMD's Windows wheels)."""
    import torch

    from rocktune.errors import UserError

    if not torch.distributed.is_available():
        raise UserError("this torch build has no torch.distributed (AMD's Windows ROCm wheels lack it), so --nproc "
                        "cannot start several processes. Train on one GPU here, or use Linux or WSL for several.")


def run_launcher(payload: dict) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(torchrun_args(payload["launch"]) + ["-m", "rocktune.train.worker", json.dumps(payload)])
    # Beside the supervisor's status file (a temporary directory of its own): the run directory may not exist.
    report = Path(payload["status_file"]).with_name(FAILURE_FILE) if payload.get("status_file") else None
    try:
        run(args)
        return 0
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        code = failure.exitcode
        cause = f"signal {failure.signal_name()}" if code < 0 else f"exit status {code}"
        if code not in (0, 2, 130):  # a user error or Ctrl-C was already told by the rank itself
            print(f"rocktune: rank {rank} failed first ({cause}); the other ranks were stopped", file=sys.stderr)
        if report is not None:
            report.write_text(json.dumps({"failed_rank": rank, "rank_cause": cause}), encoding="utf-8")
        return code if code >= 0 else 128 - code  # a signal, as a shell reports it


def run_preflight(nproc: int, timeout_s: float) -> int:
    """``rocktune doctor --nproc N``: the preflight of ``train --nproc N`` alone, on this machine's devices."""
    import os

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    os.environ["ROCKTUNE_PREFLIGHT_TIMEOUT"] = str(timeout_s)
    args = parse_args(torchrun_args({"nproc": nproc}) + ["-m", "rocktune.train.distributed"])
    try:
        run(args)
        return 0
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        return failure.exitcode if failure.exitcode > 0 else 1


def failure_details(status_file: Path, unanswered: list[int] | None = None) -> dict:
    """What the launcher recorded about the first failing rank of the last attempt ({} for one process); read once.

    In a hang the first rank to fail is the one that noticed (its collective timed out), not the one that hung: when
    rank 0's liveness check named ranks that stopped answering (``unanswered``, from its status report), the
    incident names the first of those and keeps the noticing rank as ``noticed_by``."""
    path = status_file.with_name(FAILURE_FILE)
    try:
        details = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    finally:
        path.unlink(missing_ok=True)
    noticed = details.get("failed_rank")
    if not unanswered or noticed in unanswered:  # a rank that died is both the first to fail and silent
        return details
    how = details.get("rank_cause", "an error")
    return {"failed_rank": unanswered[0], "rank_cause": f"stopped answering (hung); rank {noticed} noticed and "
            f"stopped with {how}", "noticed_by": noticed, "unanswered_ranks": list(unanswered)}


if __name__ == "__main__":
    raise SystemExit(run_launcher(json.loads(sys.argv[1])))
