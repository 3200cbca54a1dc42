"""Engines die with their run: a small supervisor between the driver and each engine server.

    python -m miles_lite.rollout.lifeline FD -- <server argv>

The driver keeps the write end of a pipe and passes the read end (FD). The supervisor forks the
server (which inherits every other descriptor, e.g. a bound listening socket), then waits for either:

- the server's exit: it kills what the server left in the process group and exits with its code;
- end-of-file on FD: the driver is gone, however it ended (SIGKILL and OOM kill included, since the
  kernel closes a dead process's descriptors). It sends SIGTERM to the process group, waits a grace
  period, then SIGKILL.

The server also gets PR_SET_PDEATHSIG=SIGKILL towards this supervisor (single-threaded, so the
parent-death signal is tied to its only thread), so killing the supervisor kills the server too.
Thread-bound parent-death signals set from the multi-threaded driver would fire when the thread that
spawned the engine ends; a pipe's end-of-file is tied to the process.
"""

from __future__ import annotations

import ctypes
import os
import resource
import select
import signal
import sys

PR_SET_PDEATHSIG = 1
GRACE_S = 10.0


def _set_parent_death_signal(sig: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")


def group_members(pgid: int) -> list[int]:
    """Pids of the processes in process group `pgid` (read from /proc)."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # ended while we looked
            continue
        if int(fields[2]) == pgid:  # fields after the command: state, ppid, pgrp
            members.append(int(entry))
    return members


def _kill_group(sig: int) -> None:
    for pid in (p for p in group_members(os.getpgrp()) if p != os.getpid()):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _exit_code(status: int) -> int:
    """The server's exit code; a server killed by a signal is mirrored (this process dies of the same one).

    SIGKILL and SIGSTOP take no handler (`signal.signal` refuses them) and are never blocked, so they are
    sent as they are; any other signal gets its default action back first (Python ignores SIGPIPE, for
    instance) and is unblocked. The server already dumped its core if the signal dumps one; this process
    does not add a second.
    """
    if not os.WIFSIGNALED(status):
        return os.waitstatus_to_exitcode(status)
    sig = os.WTERMSIG(status)
    if sig not in (signal.SIGKILL, signal.SIGSTOP):
        try:
            signal.signal(sig, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
        except (OSError, ValueError):  # a signal this platform will not let us touch: its action is the default
            pass
    try:
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    except (OSError, ValueError):
        pass
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), sig)
    return 128 + sig  # a signal whose default action does not end a process (the shell's convention)


def supervise(lifeline_fd: int, argv: list[str]) -> int:
    """Run `argv` as a child until it exits or `lifeline_fd` reads end-of-file; returns the exit code."""
    parent = os.getpid()
    child = os.fork()
    if child == 0:
        try:
            os.close(lifeline_fd)
            for sig in (signal.SIGPIPE, signal.SIGXFSZ):  # Python ignores these; exec would keep them ignored
                signal.signal(sig, signal.SIG_DFL)
            _set_parent_death_signal(signal.SIGKILL)
            if os.getppid() != parent:  # the supervisor died before the signal was armed
                os._exit(1)
            os.execvp(argv[0], argv)
        finally:
            os._exit(127)
    # A SIGTERM for this process alone (not its group) still reaches the server.
    signal.signal(signal.SIGTERM, lambda *_: os.kill(child, signal.SIGTERM))
    child_fd = os.pidfd_open(child)
    poller = select.poll()
    poller.register(child_fd, select.POLLIN)
    poller.register(lifeline_fd, select.POLLIN | select.POLLHUP)
    while True:
        try:
            ready = {fd for fd, _ in poller.poll()}
        except InterruptedError:
            continue
        if child_fd in ready:
            _, status = os.waitpid(child, 0)
            _kill_group(signal.SIGKILL)  # e.g. the workers of a server that was killed
            return _exit_code(status)
        if lifeline_fd in ready and not os.read(lifeline_fd, 1):
            print("lifeline: the run that started this engine is gone; stopping it", file=sys.stderr, flush=True)
            _kill_group(signal.SIGTERM)
            child_exit = select.poll()
            child_exit.register(child_fd, select.POLLIN)
            child_exit.poll(GRACE_S * 1000)  # the server's own shutdown, at most the grace period
            _kill_group(signal.SIGKILL)
            _, status = os.waitpid(child, 0)
            return _exit_code(status)


def main() -> None:
    args = sys.argv[1:]
    if len(args) < 3 or args[1] != "--":
        sys.exit("usage: python -m miles_lite.rollout.lifeline FD -- COMMAND [ARG...]")
    sys.exit(supervise(int(args[0]), args[2:]))


if __name__ == "__main__":
    main()
