"""Server processes started before their arguments are known, adopted later by `EngineProcess`.

A server's start is mostly imports. `PrestartPool.spawn` starts its processes at once, each under the usual
lifeline supervisor, waiting on one end of a `SOCK_SEQPACKET` socket pair for its argv (the protocol of
`engines/reference/prestart.py`); `EngineProcess(prestarted=...)` sends the argv, the log path and the bound
listening socket when it starts the engine. Processes nobody adopts end when the pool closes (end of file on
their socket, then on their lifeline).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from miles_lite.rollout import lifeline

# Seconds an unused process gets to end after its socket and lifeline close, before it is killed.
CLOSE_GRACE_S = 5.0


@dataclass
class Prestarted:
    """One waiting process: the supervisor (`proc`), the lifeline's write end, the control socket."""

    proc: subprocess.Popen
    lifeline_fd: int
    control: socket.socket
    early_log: str

    def hand_over(self, argv: Sequence[str], log_path: str, listen_fd: int | None) -> None:
        """Send the server its argv and log (and the listening socket); raises OSError if it is gone."""
        message = json.dumps({"argv": list(argv), "log": log_path}).encode()
        socket.send_fds(self.control, [message], [listen_fd] if listen_fd is not None else [])
        self.control.close()

    def discard(self) -> None:
        """End an unadopted process: close its socket and lifeline, wait for it (killed after a grace)."""
        self.control.close()
        try:
            os.close(self.lifeline_fd)
        except OSError:
            pass
        try:
            self.proc.wait(timeout=CLOSE_GRACE_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        try:
            os.unlink(self.early_log)
        except OSError:
            pass


class PrestartPool:
    """Processes `0..n-1` started ahead for the engines of the same indices; `take(i)` hands one out once."""

    def __init__(self, processes: list[Prestarted]) -> None:
        self._free: dict[int, Prestarted] = dict(enumerate(processes))

    @classmethod
    def spawn(cls, n: int, command: Sequence[str], env: Mapping[str, str] | None = None) -> PrestartPool:
        """Start `n` processes running `command + ["--prestart-fd", FD, "--prestart-log", PATH]`."""
        processes = []
        try:
            for index in range(n):
                processes.append(_spawn_one(index, list(command), env))
        except BaseException:
            for p in processes:
                p.discard()
            raise
        return cls(processes)

    def take(self, index: int) -> Prestarted | None:
        """The process started ahead for engine `index`, if it is still waiting (else None: start a new one)."""
        found = self._free.pop(index, None)
        if found is not None and found.proc.poll() is not None:
            found.discard()
            return None
        return found

    def close(self) -> None:
        """End every process not taken."""
        free, self._free = list(self._free.values()), {}
        for p in free:
            p.discard()


def _spawn_one(index: int, command: list[str], env: Mapping[str, str] | None) -> Prestarted:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    lifeline_read, lifeline_write = os.pipe()
    fd, early_log = tempfile.mkstemp(prefix=f"miles-lite-prestart-{index}-", suffix=".log")
    try:
        argv = [*command, "--prestart-fd", str(theirs.fileno()), "--prestart-log", early_log]
        supervised = [sys.executable, "-I", lifeline.__file__, str(lifeline_read), "--", *argv]
        proc = subprocess.Popen(supervised, stdout=fd, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env={**os.environ, **env} if env is not None else None,
                                pass_fds=(lifeline_read, theirs.fileno()))
    except BaseException:
        ours.close()
        os.close(lifeline_write)
        raise
    finally:
        os.close(fd)
        os.close(lifeline_read)
        theirs.close()
    return Prestarted(proc, lifeline_write, ours, early_log)
