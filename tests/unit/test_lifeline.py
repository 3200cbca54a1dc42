"""The engine supervisor (`rollout/lifeline.py`) mirrors its server's exit, run as the driver runs it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from miles_lite.rollout import lifeline


def _supervise(tmp_path, script: str) -> subprocess.CompletedProcess:
    """Run the supervisor over `sh -c script` as the driver does: its own session (it kills its whole process
    group), a lifeline pipe whose write end this test holds."""
    read, write = os.pipe()
    try:
        return subprocess.run([sys.executable, "-I", lifeline.__file__, str(read), "--", "sh", "-c", script],
                              pass_fds=(read,), start_new_session=True, capture_output=True, text=True,
                              timeout=60, cwd=tmp_path)
    finally:
        os.close(read)
        os.close(write)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGSEGV, signal.SIGPIPE, signal.SIGUSR1,
                                 signal.SIGABRT])
def test_server_killed_by_a_signal_is_mirrored_without_a_traceback(tmp_path, sig: int) -> None:
    # SIGKILL takes no handler; SIGPIPE is ignored by Python until reset; SIGSEGV/SIGABRT dump core.
    done = _supervise(tmp_path, f"ulimit -c 0; echo started; kill -{sig.name[3:]} $$")
    assert done.returncode == -sig, (done.returncode, done.stderr)
    assert done.stdout == "started\n"
    assert done.stderr == ""
    assert not [p for p in os.listdir(tmp_path) if p.startswith("core")]


@pytest.mark.parametrize("code", [0, 3, 137])
def test_server_exit_code_is_returned(tmp_path, code: int) -> None:
    done = _supervise(tmp_path, f"exit {code}")
    assert done.returncode == code
    assert done.stderr == ""


def test_a_stop_signal_is_sent_as_it_is() -> None:
    # SIGSTOP, like SIGKILL, cannot be given a handler: the status of a server ended by it (a raw wait
    # status whose low bits name the signal) stops this process instead of raising; once continued it
    # reports 128 + the signal, as a shell does.
    status = int(signal.SIGSTOP)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGSTOP
    code = (f"import sys; sys.path.insert(0, {os.path.dirname(lifeline.__file__)!r}); import lifeline; "
            f"sys.exit(lifeline._exit_code({status}))")
    proc = subprocess.Popen([sys.executable, "-I", "-c", code], stderr=subprocess.PIPE, text=True)
    try:
        _, wait_status = os.waitpid(proc.pid, os.WUNTRACED)
        assert os.WIFSTOPPED(wait_status) and os.WSTOPSIG(wait_status) == signal.SIGSTOP
        os.kill(proc.pid, signal.SIGCONT)
        _, wait_status = os.waitpid(proc.pid, 0)
        assert os.waitstatus_to_exitcode(wait_status) == 128 + signal.SIGSTOP
        assert proc.stderr.read() == ""
    finally:
        proc.returncode = 0  # reaped above
        proc.stderr.close()
