"""Crash supervision: the training runs in a child process; when it dies, continue from the last good checkpoint.

User errors and fatal diagnoses end the run (restarting would not help), and so do a full disk (exit 5), an
unexpected error before the first step (exit 6 from the child) and a failure that repeats identically before the
first step (see ``outcome``); each is recorded once in ``incidents.jsonl``. Anything else — a signal, a GPU memory
access fault, an access violation, an unexpected exit — is recorded there and the child is started again with
``--resume``, up to ``max_restarts`` times. Two faults at the same step step down to a safer profile: twice as many
pieces per micro-batch, fp32, and serialized kernels on ROCm. A child the kernel's out-of-memory killer ended
(``oomkill``) is named as such and restarted only smaller (twice the pieces); killed so again at the same step, the
run stops with exit 7 instead of looping.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.markup import escape  # causes quote library messages, which may contain [brackets]

from rocktune import exits
from rocktune.process import oomkill, outcome
from rocktune.train.request import RunRequest
from rocktune.readers.json_file import parse_json
from rocktune.readers.yaml_file import read_yaml


def supervise(request: RunRequest, max_restarts: int) -> int:
    """Run ``request`` (see ``worker.run_in_process``) in a child until it finishes, restarting it after crashes."""
    talk = tempfile.mkdtemp(prefix="rocktune-")  # the child's report (outcome.py): outside the run, which may not exist
    try:
        return _supervise(RunRequest.from_json(request.to_json()), max_restarts, Path(talk) / "status.json")
    finally:
        shutil.rmtree(talk, ignore_errors=True)


def _supervise(request: RunRequest, max_restarts: int, status: Path) -> int:
    console = Console(stderr=True, soft_wrap=True)  # one incident, one line: logs stay greppable
    request.status_file = str(status)  # the request is ours (a copy) to change between attempts
    run_dir = Path(request.run_dir)
    started = time.time()
    faults_by_step: dict[int, int] = {}
    restarts = 0
    startup_cause = None  # the cause of the last attempt's failure when it came before the first step
    oom_step = None  # the step at which the last attempt was OOM-killed
    while True:
        status.unlink(missing_ok=True)
        watch = oomkill.OomWatch()
        code, interrupted = _run_child(request)
        if interrupted:  # the user's Ctrl-C, whatever the child managed to do with it: never a crash to retry
            return exits.INTERRUPTED
        if code in exits.FINAL:
            return code if code != exits.FATAL else exits.CRASH
        step = _last_step(run_dir / "metrics.jsonl")
        report = outcome.read(status)
        oom = watch.verdict(code)
        cause = oom or report.get("cause") or _describe_exit(code)
        oom_again = oom is not None and oom_step == step  # the smaller restart did not get past it either
        repeated_at_start = not oom and not report.get("stepped") and cause == startup_cause
        final = code in (exits.DISK_FULL, exits.STARTUP) or repeated_at_start or oom_again
        gives_up = final or restarts >= max_restarts
        from rocktune.process.launch import failure_details

        ranks = failure_details(status, report.get("unanswered"))
        _record(run_dir, {"time": time.time(), "cause": cause, "last_logged_step": step, **ranks,
                          "restart": None if gives_up else restarts + 1, "max_restarts": max_restarts})
        if code == exits.DISK_FULL:
            return code  # the child said it all, in one paragraph
        if oom_again:
            console.print(f"[red]training was {escape(oom)} again at step {step}, with its micro-batches split in "
                          f"{request.options.pieces}: memory is short even so, and a restart at this size would "
                          f"loop. Lower data.max_length or training.micro_batch_size (`rocktune plan` shows what "
                          f"fits), then continue with --resume. See {run_dir / 'incidents.jsonl'}.[/]")
            return exits.OUT_OF_MEMORY
        if final:
            again = "again the same way " if repeated_at_start else ""
            console.print(f"[red]training failed {again}during start-up, before any step ({escape(cause)}); a "
                          f"restart cannot fix that, so it was not retried. See {run_dir / 'incidents.jsonl'}.[/]")
            return exits.CRASH
        startup_cause = None if report.get("stepped") else cause
        if gives_up:
            console.print(f"[red]training died ({escape(cause)}) at step {step}; {max_restarts} restarts used up. "
                          f"See {run_dir / 'incidents.jsonl'}; continue later with --resume.[/]")
            return exits.CRASH
        restarts += 1
        faults_by_step[step] = faults_by_step.get(step, 0) + 1
        oom_step = step if oom else None
        request, notes = _next_attempt(request, run_dir, started, code == exits.ROLLBACK, faults_by_step[step] >= 2,
                                       smaller=oom is not None)
        console.print(f"[yellow]training died ({escape(cause)}) at step {step}; restart {restarts}/{max_restarts} "
                      f"from the last good checkpoint{'; ' + '; '.join(notes) if notes else ''}[/]")


def _next_attempt(request: RunRequest, run_dir: Path, started: float, rollback: bool, repeated: bool,
                  smaller: bool = False) -> tuple[RunRequest, list[str]]:
    """``smaller``: the last attempt was OOM-killed; split its forwards, and never step up to fp32 (more memory)."""
    notes = []
    options = request.options
    saved = run_dir / "config.yaml"
    if saved.is_file() and saved.stat().st_mtime >= started - 1:  # 1 s: coarse mtimes on some filesystems
        # Our child started the run: continue exactly that run (its config, already fitted by --auto), never wipe.
        request = dataclasses.replace(request, config=read_yaml(saved, "it was written by this run's child.")[0])
        options = dataclasses.replace(options, overwrite=False, resume=True, auto_fit=False)
    # Otherwise the child died before it wrote anything: repeat the first attempt as asked (--overwrite included).
    training = request.config["training"]
    if (rollback or repeated) and not smaller and training["precision"] != "fp32":
        training["precision"] = "fp32"
        options = dataclasses.replace(options, resume_force=True)  # the supervisor's own, announced change
        notes.append("precision -> fp32")
    if repeated or smaller:
        options = dataclasses.replace(options, pieces=options.pieces * 2)
        notes.append(f"micro-batches split in {options.pieces}")
    if repeated and not smaller:
        if os.environ.get("AMD_SERIALIZE_KERNEL") is None and _is_rocm():
            os.environ["AMD_SERIALIZE_KERNEL"] = "3"
            notes.append("AMD_SERIALIZE_KERNEL=3 (serialized kernels)")
    return dataclasses.replace(request, options=options), notes


def _run_child(request: RunRequest) -> tuple[int, bool]:
    """Run the worker in its own session / process group, so a terminal's Ctrl-C reaches only us; we forward it
    once (the child checkpoints and exits cleanly), and a second Ctrl-C kills the child.
    Returns the exit code and whether the user interrupted."""
    from rocktune.process.launch import child_command
    from rocktune.train.rundir import STOP_FILE

    cmd = child_command(request)
    stop_file = Path(request.run_dir) / STOP_FILE
    stop_file.unlink(missing_ok=True)  # left by an earlier Ctrl-C: this attempt must not stop at once
    if os.name == "nt":
        proc = subprocess.Popen(cmd, creationflags=subprocess.CREATE_NEW_PROCESS_GROUP)
        polite = signal.CTRL_BREAK_EVENT  # the only console event a new process group can be sent
    else:
        proc = subprocess.Popen(cmd, start_new_session=True)
        polite = signal.SIGINT
    interrupts = 0

    def on_sigint(signum, frame):
        nonlocal interrupts
        interrupts += 1
        if interrupts == 1 and request.multi:
            # torchrun does not pass a Ctrl-C on to its workers: rank 0 polls this file and all ranks stop together.
            stop_file.parent.mkdir(parents=True, exist_ok=True)
            stop_file.touch()
        elif interrupts == 1:
            proc.send_signal(polite)
        elif interrupts == 2 and request.multi:
            # torchrun runs each worker in a session of its own: only its agent can stop them all (on SIGTERM)
            proc.terminate()
        else:
            proc.kill()

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        return proc.wait(), interrupts > 0
    finally:
        signal.signal(signal.SIGINT, previous)
        if interrupts > 1:
            raise SystemExit(exits.INTERRUPTED)


def _describe_exit(code: int) -> str:
    if code == exits.ROLLBACK:
        return "non-finite loss or gradients several steps in a row"
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    if code >= 0xC0000000:  # a Windows NTSTATUS, e.g. 0xC0000005 for an access violation
        return f"exit status 0x{code:08X}" + (" (access violation)" if code == 0xC0000005 else "")
    return f"exit status {code}"


def _last_step(metrics: Path) -> int:
    step = 0
    if metrics.is_file():
        for line in metrics.read_text(encoding="utf-8").splitlines():
            try:
                step = max(step, int(parse_json(line).get("step", 0)))
            except ValueError:
                break  # a line cut short by the crash
    return step


def _record(run_dir: Path, incident: dict) -> None:
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        with open(run_dir / "incidents.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps(incident) + "\n")
    except OSError:
        pass  # a full disk: the record is lost, the message on the terminal is not


def _is_rocm() -> bool:
    import torch

    return torch.version.hip is not None
