"""`EngineProcess` on real child processes: small Python HTTP servers standing in for engine servers."""

from __future__ import annotations

import os
import signal
import socket
import sys
import time

import pytest

from miles_lite.rollout.process import EngineProcess, EngineStartError, ProcessState

# A stand-in server: answers /health_generate with 200, optionally serving on an inherited socket,
# optionally ignoring SIGTERM and optionally leaving a grandchild that shares its process group.
SERVER = r"""
import http.server, os, signal, socket, subprocess, sys
port, fd, ignore_term, grandchild = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1", sys.argv[4] == "1"
if ignore_term:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if grandchild:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print("grandchild", child.pid, flush=True)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health_generate" else 404); self.end_headers()
    def log_message(self, *a): pass
srv = http.server.HTTPServer(("127.0.0.1", port), H, bind_and_activate=fd < 0)
if fd >= 0:
    srv.socket = socket.socket(fileno=fd); srv.socket.listen()
print("serving", flush=True)
srv.serve_forever()
"""


def _factory(ignore_term: bool = False, grandchild: bool = False):
    def command(port: int, fd: int | None) -> list[str]:
        return [sys.executable, "-c", SERVER, str(port), str(-1 if fd is None else fd), str(int(ignore_term)),
                str(int(grandchild))]
    return command


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); read its state.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[1].split()[0] != "Z"


@pytest.mark.parametrize("pass_socket", [False, True])
def test_lifecycle_ready_then_stopped(tmp_path, pass_socket: bool) -> None:
    proc = EngineProcess("fake", _factory(), str(tmp_path / "e.log"), pass_socket=pass_socket)
    assert proc.state is ProcessState.CREATED and proc.pid is None
    proc.start()
    assert proc.state is ProcessState.STARTING
    proc.wait_ready(timeout_s=30)
    assert proc.state is ProcessState.READY and proc.alive()
    assert proc.url == f"http://127.0.0.1:{proc.port}"
    assert proc.stop(grace_s=10) == -signal.SIGTERM
    assert proc.state is ProcessState.STOPPED and not proc.alive()
    assert "serving" in proc.log_tail()


def test_exit_during_startup_raises_with_log_tail(tmp_path) -> None:
    def command(port: int, fd: int | None) -> list[str]:
        return [sys.executable, "-c", "import sys; print('model weights are missing'); sys.exit(3)"]

    proc = EngineProcess("broken", command, str(tmp_path / "e.log"))
    proc.start()
    with pytest.raises(EngineStartError, match="exited with code 3(.|\n)*model weights are missing"):
        proc.wait_ready(timeout_s=30)
    assert proc.state is ProcessState.FAILED
    proc.stop()
    assert proc.state is ProcessState.STOPPED


def test_never_healthy_times_out_and_stop_kills(tmp_path) -> None:
    def command(port: int, fd: int | None) -> list[str]:
        return [sys.executable, "-c", "import time; print('loading forever', flush=True); time.sleep(600)"]

    proc = EngineProcess("slow", command, str(tmp_path / "e.log"))
    proc.start()
    start = time.monotonic()
    with pytest.raises(EngineStartError, match="not healthy after 1s(.|\n)*loading forever"):
        proc.wait_ready(timeout_s=1.0, poll_interval_s=0.1)
    assert time.monotonic() - start < 10
    pid = proc.pid
    proc.stop(grace_s=5)
    assert not _alive(pid)


def test_stop_escalates_to_sigkill_and_reaps_the_group(tmp_path) -> None:
    proc = EngineProcess("stubborn", _factory(ignore_term=True, grandchild=True), str(tmp_path / "e.log"))
    proc.start()
    proc.wait_ready(timeout_s=30)
    grandchild = int(next(line for line in proc.log_tail().splitlines() if line.startswith("grandchild")).split()[1])
    assert _alive(grandchild)
    start = time.monotonic()
    assert proc.stop(grace_s=0.5) == -signal.SIGKILL
    assert time.monotonic() - start < 10
    deadline = time.monotonic() + 10
    while _alive(grandchild) and time.monotonic() < deadline:  # the grandchild is reaped by init
        time.sleep(0.05)
    assert not _alive(grandchild)


def test_dead_ready_engine_becomes_failed(tmp_path) -> None:
    proc = EngineProcess("dies", _factory(), str(tmp_path / "e.log"))
    proc.start()
    proc.wait_ready(timeout_s=30)
    os.kill(proc.pid, signal.SIGKILL)
    proc._proc.wait()
    assert not proc.alive()
    assert proc.state is ProcessState.FAILED and "exited with code -9" in proc.failure
    proc.stop()
    assert proc.state is ProcessState.STOPPED


def test_port_clash_is_retried_on_a_fresh_port(tmp_path) -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    calls: list[int] = []

    def command(port: int, fd: int | None) -> list[str]:
        calls.append(port)
        # The first spawn "loses the race": it tries a port someone else holds.
        chosen = taken.getsockname()[1] if len(calls) == 1 else port
        return _factory()(chosen, None)

    proc = EngineProcess("racy", command, str(tmp_path / "e.log"))
    try:
        proc.start()
        proc.wait_ready(timeout_s=30)
        assert len(calls) == 2 and proc.state is ProcessState.READY
        assert "Address already in use" in proc.log_tail(100)
    finally:
        proc.stop()
        taken.close()


def test_illegal_transitions_raise(tmp_path) -> None:
    proc = EngineProcess("x", _factory(), str(tmp_path / "e.log"))
    with pytest.raises(RuntimeError, match="wait_ready in state created"):
        proc.wait_ready(timeout_s=1)
    with pytest.raises(RuntimeError, match="no URL before start"):
        _ = proc.url
    assert proc.stop() is None and proc.state is ProcessState.STOPPED
    with pytest.raises(RuntimeError, match="illegal transition stopped -> starting"):
        proc.start()


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                if entry.isdigit() and int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(entry))
        except OSError:
            continue
    return out


def _gone(pids: list[int], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)  # poll interval of the check above
    return not any(_alive(p) for p in pids)


# A run that starts an engine (server + grandchild) and then blocks; the test SIGKILLs it.
RUN = r"""
import sys
from miles_lite.rollout.process import EngineProcess
server, log = sys.argv[1], sys.argv[2]
proc = EngineProcess("e", lambda port, fd: [sys.executable, "-c", server, str(port), "-1", "0", "1"], log)
proc.start()
proc.wait_ready(timeout_s=60)
print(proc.pid, flush=True)
sys.stdin.read()
"""


def test_engine_dies_with_a_sigkilled_run(tmp_path) -> None:
    import subprocess

    run = subprocess.Popen([sys.executable, "-c", RUN, SERVER, str(tmp_path / "e.log")], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, text=True)
    try:
        assert run.stdout is not None
        supervisor = int(run.stdout.readline())
        servers = _children(supervisor)
        log = (tmp_path / "e.log").read_text().splitlines()
        grandchild = int(next(line for line in log if line.startswith("grandchild")).split()[1])
        assert len(servers) == 1 and _alive(servers[0]) and _alive(grandchild)
        run.kill()  # no clean-up code of the run runs
        run.wait()
        assert _gone([supervisor, *servers, grandchild], 20), "an engine process outlived its run"
        assert "the run that started this engine is gone" in (tmp_path / "e.log").read_text()
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()


def test_server_dies_with_a_sigkilled_supervisor(tmp_path) -> None:
    proc = EngineProcess("e", _factory(grandchild=True), str(tmp_path / "e.log"))
    proc.start()
    proc.wait_ready(timeout_s=30)
    servers = _children(proc.pid)
    assert len(servers) == 1
    os.kill(proc.pid, signal.SIGKILL)
    assert _gone(servers, 10)
    proc.stop()
