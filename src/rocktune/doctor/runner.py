"""Drive the check child process; turn a dead or hung child into a failed check and carry on with the rest."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

from rocktune.doctor.checks import CheckResult


CHILD = ("rocktune.doctor.child",)


def run_checks(device: str, names: list[str], env: dict[str, str], timeout: float = 300.0,
               child: tuple[str, ...] = CHILD) -> list[CheckResult]:
    """``child``: the module that runs the checks (``python -m MODULE DEVICE [ARGS...] NAMES_JSON``) and its extra
    arguments; it speaks the protocol of doctor/child.py."""
    results: dict[str, CheckResult] = {}
    remaining = list(names)
    while remaining:
        out, err, rc = _run_child([device, *child[1:]], remaining, env, timeout, child[0])
        current, started = None, False
        for line in out.splitlines():
            if line.startswith("@@start "):
                current, started = line[len("@@start "):], True
            elif line.startswith("@@result "):
                data = json.loads(line[len("@@result "):])
                results[data["name"]] = CheckResult(**data)
                current = None
        missing = [n for n in remaining if n not in results]
        if rc != 0 and missing:
            tail = " | ".join(err.strip().splitlines()[-3:])[:400] or "no output"
            detail = f"the check process {_describe_exit(rc, timeout)}: {tail}"
            # died inside a check: that check failed, the rest get a fresh process; died before any: all failed
            for name in [current or missing[0]] if started else missing:
                results[name] = CheckResult(name, "fail", detail)
        elif missing:  # the child returned without reporting them: a bug, not a pass
            for name in missing:
                results[name] = CheckResult(name, "fail", "the check process exited without a result")
        remaining = [n for n in remaining if n not in results]
    return [results[n] for n in names]


def _run_child(args: list[str], names: list[str], env: dict[str, str], timeout: float, module: str
               ) -> tuple[str, str, int]:
    cmd = [sys.executable, "-m", module, *args, json.dumps(names)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
        return proc.stdout, proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        return _text(exc.stdout), _text(exc.stderr), -9999


def _text(data) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else (data or "")


def _describe_exit(rc: int, timeout: float) -> str:
    if rc == -9999:
        return f"hung (no result within {timeout:.0f} s) and was killed"
    if rc < 0:
        try:
            return f"died with {signal.Signals(-rc).name}"
        except ValueError:
            return f"died with signal {-rc}"
    if rc > 255:  # Windows: NTSTATUS, e.g. 0xC0000005 is an access violation
        return f"died with status {rc & 0xFFFFFFFF:#010x}"
    return f"exited with status {rc}"
