"""One writer per run directory: an advisory `flock` on `<dir>/.lock`, which names its holder.

A second run with the same `experiment.run_name` (or the same `checkpoint.dir`) would otherwise adopt
the first one's live checkpoints, append to its metrics file and, at start-up, remove the temporary
directory of its save in flight. The kernel drops the lock when the holding process exits, however it
exits (a SIGKILL, a pre-empted node's requeued job finds it free), so there is no stale lock to clean.
"""

from __future__ import annotations

import fcntl
import os
import socket
import time
from pathlib import Path

LOCK_FILE = ".lock"


class RunDirInUseError(RuntimeError):
    """Another live process holds the directory's lock."""


class RunLock:
    """Holds `<directory>/.lock` exclusively until `release()` (or the process ends).

    Raises `RunDirInUseError` naming the holder (host, pid, start time) when another process holds it.
    """

    def __init__(self, directory: str | Path, what: str = "run directory") -> None:
        self.path = Path(directory) / LOCK_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Opened without truncation: the holder's line must survive a failed attempt to take the lock.
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "an unknown process"
            os.close(fd)
            raise RunDirInUseError(
                f"{what} {self.path.parent} is in use by {holder}; wait for that run to end or stop it, "
                "or choose another experiment.run_name (and checkpoint.dir)") from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"host {socket.gethostname()} pid {os.getpid()} since "
                      f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}\n".encode(), 0)
        self._fd: int | None = fd

    def release(self, remove_file: bool = False) -> None:
        """Unlock (idempotent). The file stays (an unlocked file means a free directory) unless
        `remove_file`, for a directory this run created and leaves empty."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.ftruncate(fd, 0)
            if remove_file:
                self.path.unlink(missing_ok=True)
            os.close(fd)

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
