"""A hang is recorded against the rank that hung, not the rank that noticed it (issue 31).

No processes: the collective's timeout and gloo's liveness check are replaced by the errors they raise, and the
supervisor's child by a script, as in ``test_supervisor_restarts_only_what_a_restart_can_fix``. The full hang
under torchrun is ``test_distributed.py::test_hung_rank_is_named_within_the_timeout_and_the_run_recovers`` (slow).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rocktune.train import distributed
from rocktune.train.distributed import Dist, DistributedFailure

# gloo's own words (torch's ProcessGroupGloo::monitoredBarrier), as rank 0 sees a hung peer
GLOO_MISSING = "[/pytorch/third_party/gloo/...] Ranks 1 failed to pass monitoredBarrier in 15000 ms"


@pytest.mark.parametrize("text, ranks", [
    (GLOO_MISSING, (1,)),
    ("Rank 3 failed to pass monitoredBarrier in 100 ms", (3,)),
    ("Ranks 1, 2, 5 failed to pass monitoredBarrier in 100 ms", (1, 2, 5)),
    ("Connection closed by peer [127.0.0.1]:1234", ()),
])
def test_missing_ranks_read_from_the_liveness_check(text, ranks):
    assert distributed.missing_ranks(text) == ranks


def test_timed_out_collective_carries_the_ranks_that_stopped_answering(monkeypatch):
    import torch
    import torch.distributed as td

    def timed_out(*args, **kwargs):
        raise RuntimeError("[gloo] Timed out waiting 15000ms for recv operation to complete")

    def liveness(*args, **kwargs):
        raise RuntimeError(GLOO_MISSING)

    monkeypatch.setattr(td, "all_reduce", timed_out)
    monkeypatch.setattr(td, "monitored_barrier", liveness)
    with pytest.raises(DistributedFailure) as caught:
        distributed.reduce_step(Dist(rank=0, world=2, timeout_s=15.0), torch.tensor(1.0), False, 3)
    assert caught.value.unanswered == (1,)
    assert str(caught.value).startswith("rank 0: the all-reduce of step 3's loss did not complete")
    assert "Ranks 1 failed to pass monitoredBarrier" in str(caught.value)


def _supervise(tmp_path, monkeypatch, launcher: dict, unanswered: tuple[int, ...]) -> dict:
    """One scripted attempt failing as rank 0 reports it (``unanswered``) and torchrun names it (``launcher``), then
    a clean one; returns the one incident recorded."""
    from rocktune.process import launch, outcome, supervisor
    from rocktune.train.request import RunRequest

    attempts = iter([1, 0])

    def fake_child(request):
        code = next(attempts)
        if code:
            status = Path(request.status_file)
            outcome.Report(str(status)).failed("DistributedFailure: rank 0: the all-reduce ...", unanswered)
            status.with_name(launch.FAILURE_FILE).write_text(json.dumps(launcher))
        return code, False

    monkeypatch.setattr(supervisor, "_run_child", fake_child)
    run_dir = tmp_path / "run"
    request = RunRequest({"output": {"dir": str(run_dir)}, "training": {"precision": "fp32"}})
    assert supervisor.supervise(request, max_restarts=3) == 0
    [incident] = [json.loads(x) for x in (run_dir / "incidents.jsonl").read_text().splitlines()]
    return incident


def test_hang_incident_names_the_hung_rank_and_who_noticed(tmp_path, monkeypatch):
    incident = _supervise(tmp_path, monkeypatch, {"failed_rank": 0, "rank_cause": "exit status 1"}, (1,))
    assert (incident["failed_rank"], incident["noticed_by"], incident["unanswered_ranks"]) == (1, 0, [1])
    assert incident["rank_cause"] == "stopped answering (hung); rank 0 noticed and stopped with exit status 1"
    assert incident["restart"] == 1


def test_killed_rank_stays_named_by_the_launcher(tmp_path, monkeypatch):
    # the dead rank fails first and is also missing from the liveness check: torchrun's account stands
    incident = _supervise(tmp_path, monkeypatch, {"failed_rank": 1, "rank_cause": "signal SIGKILL"}, (1,))
    assert (incident["failed_rank"], incident["rank_cause"]) == (1, "signal SIGKILL")
    assert "noticed_by" not in incident
