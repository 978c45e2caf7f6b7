"""One private temporary folder for a command that needs one (export, generate), removed when the command ends or
dies.

Importing torch's compiler (peft and bitsandbytes do, for their ``torch.compile`` decorators) creates an inductor
cache folder in the system temporary folder, and a killed export left its staging folders there too. Inside
``private_tempdir()`` everything goes in ``rocktune-tmp-<pid>-*`` instead: removed when the command returns or
raises, on Ctrl-C and on SIGTERM/SIGHUP; one left by a process killed outright (SIGKILL, power loss) is removed by
the next command that starts, once its process is gone. Compiling is switched off too: nothing export or generate
does needs it.

A low layer: standard library only, entered by the CLI before torch is imported.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path

PREFIX = "rocktune-tmp-"
# torch reads these when its compiler is first imported; child processes inherit them through the environment
CACHE_VARS = {"TORCHINDUCTOR_CACHE_DIR": "inductor", "TRITON_CACHE_DIR": "triton"}


@contextlib.contextmanager
def private_tempdir() -> Iterator[Path]:
    """Make a fresh folder the one Python, torch and child processes use as their temporary folder for the body,
    then remove it and restore what was there before."""
    system = Path(tempfile.gettempdir())
    if os.name == "posix":  # Windows has no uid, and its os.kill(pid, 0) would end the process it asks about
        sweep(system)
    folder = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=system))
    settings = {"TMPDIR": str(folder), "TORCHDYNAMO_DISABLE": "1",
                **{var: str(folder / sub) for var, sub in CACHE_VARS.items()}}
    saved_env = {var: os.environ.get(var) for var in settings}
    saved_tempdir, saved_signals = tempfile.tempdir, _exit_on_termination()
    os.environ.update(settings)
    tempfile.tempdir = str(folder)
    try:
        yield folder
    finally:
        tempfile.tempdir = saved_tempdir
        for var, value in saved_env.items():
            if value is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = value
        for sig, handler in saved_signals.items():
            signal.signal(sig, handler)
        shutil.rmtree(folder, ignore_errors=True)


def sweep(system: Path) -> list[Path]:
    """Remove the folders of rocktune processes that are gone (killed before their own cleanup could run); only this
    user's, and never a live process's. Returns what was removed."""
    removed = []
    for folder in system.glob(f"{PREFIX}*"):
        pid = folder.name.removeprefix(PREFIX).split("-", 1)[0]
        try:
            mine = folder.is_dir() and folder.stat().st_uid == os.getuid()
        except OSError:
            continue
        if mine and pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process holds that id now
    return True


def _exit_on_termination() -> dict:
    """SIGTERM and SIGHUP end Python without unwinding; as SystemExit they unwind through the ``finally`` blocks
    (staged outputs and this folder are removed). Returns the handlers replaced, to restore them."""
    def stop(signum, _frame):
        raise SystemExit(128 + signum)

    replaced = {}
    for name in ("SIGTERM", "SIGHUP"):
        sig = getattr(signal, name, None)
        if sig is None or signal.getsignal(sig) != signal.SIG_DFL:
            continue  # absent on this system, or the caller handles it already
        try:
            replaced[sig] = signal.signal(sig, stop)
        except ValueError:  # not the main thread: signals are the caller's
            break
    return replaced
