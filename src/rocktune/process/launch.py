"""``rocktune train --nproc N``: several worker processes through torchrun's launcher (``torch.distributed.run``).

The supervised child is then this launcher instead of one worker: ``python -m rocktune.process.launch REQUEST``. It
runs torchrun in-process (``--max-restarts 0``: restarting is the supervisor's job, from the last checkpoint) and
turns torchrun's "a child failed" into the first failing rank's own exit status, so a user error in every rank is
still a user error (exit 2, never retried) and a killed rank is still a crash to restart. It names that rank on
stderr and in ``rank_failure.json`` beside the supervisor's status file, for its incident log.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from rocktune import exits
from rocktune.train.request import Launch, RunRequest

FAILURE_FILE = "rank_failure.json"


def torchrun_args(launch: Launch) -> list[str]:
    """One node: ``--standalone`` (a free local port). Several: a static master (``--master-addr/--master-port``
    with ``--node-rank``) or a c10d rendezvous endpoint (``--rdzv-endpoint``)."""
    args = ["--nproc-per-node", str(launch.nproc), "--max-restarts", "0"]
    if launch.nnodes == 1 and not launch.rdzv_endpoint and not launch.master_addr:
        return args + ["--standalone"]
    args += ["--nnodes", str(launch.nnodes)]
    # torchrun's own rendezvous gets the same bound as the preflight (process/rendezvous.py), not its 600-900 s
    bound = str(launch_bound(launch))
    if launch.rdzv_endpoint:
        return args + ["--rdzv-conf", f"join_timeout={bound}", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                       launch.rdzv_endpoint, "--rdzv-id", launch.rdzv_id or "rocktune"]
    return args + ["--rdzv-conf", f"timeout={bound}", "--node-rank", str(launch.node_rank), "--master-addr",
                   launch.master_addr, "--master-port", str(launch.master_port)]


def child_command(request: RunRequest) -> list[str]:
    module = "rocktune.process.launch" if request.multi else "rocktune.process.worker"
    return [sys.executable, "-m", module, request.to_json()]


def check_available() -> None:
    """Refuse early, with the way out, where this torch has no torch.distributed (AMD's Windows wheels)."""
    import torch

    from rocktune.errors import UserError

    if not torch.distributed.is_available():
        raise UserError("this torch build has no torch.distributed (AMD's Windows ROCm wheels lack it), so --nproc "
                        "cannot start several processes. Train on one GPU here, or use Linux or WSL for several.")


def run_launcher(request: RunRequest) -> int:
    import os

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    from rocktune.platform.threads import rank_environment

    # The ranks share this machine's cores; with OMP_NUM_THREADS set, torchrun also keeps its 4-line warning to itself.
    os.environ.update(rank_environment(request.launch.nproc))
    args = parse_args(torchrun_args(request.launch) + ["-m", "rocktune.process.worker", request.to_json()])
    # Beside the supervisor's status file (a temporary directory of its own): the run directory may not exist.
    report = Path(request.status_file).with_name(FAILURE_FILE) if request.status_file else None
    try:
        run(args)
        return exits.OK
    except _rendezvous_errors() as exc:
        # The nodes never met (the preflight passed, then a node went away): one paragraph, and exit 2 so that the
        # supervisor does not restart a rendezvous that never formed.
        from rocktune.errors import first_line, print_error

        where = request.launch.rdzv_endpoint or f"{request.launch.master_addr}:{request.launch.master_port}"
        print_error(f"the nodes did not meet within {launch_bound(request.launch)} s at {where} "
                    f"({type(exc).__name__}: {first_line(exc)}); nothing was trained. Start every node with the same "
                    "--master-addr/--master-port (or --rdzv-endpoint), or give them longer with --rendezvous-timeout "
                    "SECONDS.")
        return exits.USER_ERROR
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        code = failure.exitcode
        cause = f"signal {failure.signal_name()}" if code < 0 else f"exit status {code}"
        if code not in (exits.OK, exits.USER_ERROR, exits.INTERRUPTED):  # the rank itself told those
            print(f"rocktune: rank {rank} failed first ({cause}); the other ranks were stopped", file=sys.stderr)
        if report is not None:
            report.write_text(json.dumps({"failed_rank": rank, "rank_cause": cause}), encoding="utf-8")
        return code if code >= 0 else 128 - code  # a signal, as a shell reports it


def launch_bound(launch: Launch) -> int:
    return math.ceil(launch.rendezvous_timeout_s)


def _rendezvous_errors() -> tuple[type[BaseException], ...]:
    from torch.distributed import DistStoreError
    from torch.distributed.elastic.rendezvous.api import RendezvousError

    return (RendezvousError, DistStoreError)


def run_preflight(nproc: int, timeout_s: float) -> int:
    """``rocktune doctor --nproc N``: the preflight of ``train --nproc N`` alone, on this machine's devices."""
    import os

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    from rocktune.platform.threads import rank_environment

    os.environ["ROCKTUNE_PREFLIGHT_TIMEOUT"] = str(timeout_s)
    os.environ.update(rank_environment(nproc))
    args = parse_args(torchrun_args(Launch(nproc=nproc)) + ["-m", "rocktune.train.distributed"])
    try:
        run(args)
        return exits.OK
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        return failure.exitcode if failure.exitcode > 0 else exits.CRASH


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
    from rocktune.process.pipes import guard_std_streams

    guard_std_streams()  # a closed pipe is not a crash (pipes.py)
    raise SystemExit(run_launcher(RunRequest.from_json(sys.argv[1])))
