"""One training process per run directory at a time.

Two processes training the same run directory each append their own copy of every metrics line and overwrite each
other's checkpoints: the log ends with a step range twice and a later resume counts lines from the wrong attempt.
That happens when a supervisor is killed (its worker, orphaned, finishes its step and checkpoints before it stops)
and the run is resumed at once, or when a run is resumed by hand while its supervisor is already restarting it.

The lock is an OS lock on ``RUN/.lock`` (``flock`` on POSIX, ``msvcrt.locking`` on Windows), taken before the run
directory is read (is it complete? which checkpoint?) and held until the process ends; the kernel releases it when
the holder dies, even by SIGKILL, so a crash never leaves a stale lock. (No lock library: the one at hand falls back
to a lock file's mere existence where OS locks fail, which a SIGKILL would leave behind.) The holder's pid is written
in the file. A second process waits for the first to stop, saying so, then reads the directory as the first left
it. A run directory that does not exist yet is locked as soon as it is created (the checks before that write
nothing). The lock file stays: deleting a lock file another process may be waiting on would let a third one lock a
new file beside it.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from rocktune.errors import UserError

LOCK_NAME = ".lock"
WAIT_S = 900.0  # an orphaned worker finishes a step and writes a checkpoint; a large model's may take minutes
POLL_S = 0.5
_WIN_OFFSET = 1 << 20  # Windows locks a byte range: one past the pid, so a waiter can still read the pid


class RunLock:
    """``with RunLock(run_dir):`` holds the run directory's lock (when it exists; ``take`` again once created)."""

    def __init__(self, run_dir: Path, enabled: bool = True, wait_s: float = WAIT_S, say=None):
        self.run_dir, self.enabled, self.wait_s = Path(run_dir), enabled, wait_s
        self.say = say or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self._fd: int | None = None

    def take(self) -> None:
        """Lock the run directory if it exists and this process does not hold it yet; wait for another holder."""
        if not self.enabled or self._fd is not None or not self.run_dir.is_dir():
            return
        path = self.run_dir / LOCK_NAME
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            if not _try_lock(fd):
                self._wait(fd, path)
        except OSError as exc:  # a filesystem without locks (some network mounts): go on as before, said once
            os.close(fd)
            self.say(f"note: {self.run_dir} cannot be locked here ({exc}); do not train it from two processes at once")
            return
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)  # the holder's pid, for the waiting message of the next process
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd

    def _wait(self, fd: int, path: Path) -> None:
        self.say(f"another rocktune process (pid {_holder(path)}) is training {self.run_dir} right now (a worker "
                 "whose supervisor was killed finishes its step and checkpoints, then stops); waiting for it to "
                 "finish before reading the run directory")
        t0 = time.monotonic()
        while not _try_lock(fd):
            if time.monotonic() - t0 > self.wait_s:
                raise UserError(f"{self.run_dir} is still being trained by another process (pid {_holder(path)}) "
                                f"after {self.wait_s:.0f} s of waiting. Two processes writing one run directory "
                                "would log every step twice and overwrite each other's checkpoints. Let it finish "
                                "(a --resume then says the run is complete), stop it, or choose another output.dir.")
            time.sleep(POLL_S)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor releases the lock (and the kernel does so at any death)
            self._fd = None

    def __enter__(self) -> RunLock:
        self.take()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _try_lock(fd: int) -> bool:
    """Take the exclusive lock without blocking; False when another process holds it."""
    if os.name == "nt":
        import msvcrt

        os.lseek(fd, _WIN_OFFSET, os.SEEK_SET)
        try:
            msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)  # type: ignore[attr-defined]  # Windows-only module; mypy checks for this platform
        except OSError:  # held by another process (locking raises the same error for every refusal)
            return False
        return True
    import fcntl

    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:  # held by another process; any other error: this filesystem cannot lock
        return False
    return True


def _holder(path: Path) -> str:
    try:
        return path.read_text().strip() or "?"
    except OSError:
        return "?"
