"""``rocktune doctor``: snapshot the platform, advise, run the self-tests in a child process, report."""

from __future__ import annotations

import math
import os
from dataclasses import asdict

from rocktune.platform.advise import advise
from rocktune.platform.detect import detect, load_platform
from rocktune.platform.environment import apply_advice


def run_doctor(as_json: bool = False, no_device: bool = False, simulate: str | None = None,
               run_checks: bool = True, perf: bool = True, timeout: float = 300.0, more=None) -> int:
    """Exit status: 1 when a check failed, else 0. ``simulate`` computes advice for a snapshot, running nothing.
    ``more(device, precision) -> (child, names)``: further checks run by another child module after the device's
    own (``--model``: that model's training path, from the LM task, which this layer does not import)."""
    if simulate:
        plat = load_platform(simulate)
    else:
        # the parent never initialises the GPU: a fault at init must not kill the doctor
        plat = detect("passive" if no_device else "child")
    advice = advise(plat)
    report = {"platform": plat.to_dict(), "advice": advice.to_dict(), "checks": []}
    if not simulate:  # what `train` would pick here: a snapshot has no affinity mask or cgroup to read
        from rocktune.platform.threads import choose_threads

        report["load"] = machine_load()
        report["threads"] = choose_threads(probe=not plat.devices or no_device).note
    if run_checks and not simulate:
        device = "cuda" if plat.devices and not no_device else "cpu"
        env = dict(os.environ)
        report["advice"]["applied_for_checks"] = apply_advice(advice, env)  # the checks see what `train` would set
        report["device"] = device
        results = _checks(device, env, perf, timeout)
        if more is not None:
            from rocktune.doctor.runner import run_checks as run_child_checks

            child, names = more(device, advice.defaults.precision if device != "cpu" else "fp32")
            results += run_child_checks(device, names, env, timeout, child)
        report["checks"] = [asdict(r) for r in results]
    if as_json:
        import json
        import sys

        sys.stdout.write(json.dumps(_finite(report), indent=2) + "\n")
    else:
        from rocktune.doctor.render import render

        render(report)
    return 1 if any(c["status"] == "fail" for c in report["checks"]) else 0


def machine_load() -> dict | None:
    """The work other processes keep the usable CPUs busy with, and whether it already fills them (a CPU run then
    measures its threads and runs slower than on a quiet machine); None where it cannot be seen."""
    from rocktune.platform.thread_probe import load_seen
    from rocktune.platform.threads import affinity_cpus, oversubscribed

    load = load_seen(0.5)
    if load is None:
        return None
    cpus = affinity_cpus()
    return {"busy": round(load.busy, 2), "source": load.source, "cpus": cpus,
            "oversubscribed": oversubscribed(load.busy, cpus)}


def _checks(device: str, env: dict[str, str], perf: bool, timeout: float):
    from rocktune.doctor.registry import plan
    from rocktune.doctor.runner import run_checks

    names = [name for name, _ in plan(device, perf=perf)]
    return run_checks(device, names, env, timeout)


def _finite(obj):
    """JSON has no Infinity/NaN: write them as strings."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite(v) for v in obj]
    return obj
