"""One engine server as a child process: spawn, readiness, liveness and shutdown, with explicit states.

    created -> starting -> ready -> stopping -> stopped
                  |          |                   ^
                  +----------+-----> failed -----+

The child runs in its own session (`start_new_session=True`), so `stop()` signals its whole process group
(SGLang's scheduler and detokenizer children included): SIGTERM, a grace period, then SIGKILL. Output goes
to a log file whose tail is attached to every startup error.

Engines die with their run: each server runs under `lifeline.py`, a supervisor that stops it when this
process is gone however it ended (SIGKILL included), and whose death kills the server too.

Started ahead: a run may start the server processes before it knows their arguments (`rollout.prestarted`:
they import their libraries meanwhile); the first start of an `EngineProcess` given one hands it the argv,
the log path and the bound socket instead of spawning.

Ports without races: when the server can take an inherited socket (the reference engine's `--listen-fd`),
the parent binds port 0 itself and passes the bound socket, so no other process can take the port in
between. Servers that must bind by number (SGLang) get a port probed free just before spawning; if the
child still dies with "address already in use" in its log, it is respawned on a fresh port, up to
`port_retries` times.
"""

from __future__ import annotations

import asyncio
import enum
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping

from miles_lite.net.api_key import authorization
from miles_lite.net.ports import LOCAL_HOST, free_port
from miles_lite.rollout import lifeline
from miles_lite.rollout.prestarted import Prestarted

# (port, fd of an inherited bound socket or None) -> argv of the server.
CommandFactory = Callable[[int, int | None], list[str]]

_PORT_CLASH = ("address already in use", "errno 98", "eaddrinuse")


class ProcessState(enum.Enum):
    CREATED = "created"
    STARTING = "starting"
    READY = "ready"
    STOPPING = "stopping"
    STOPPED = "stopped"
    FAILED = "failed"


_TRANSITIONS: dict[ProcessState, frozenset[ProcessState]] = {
    ProcessState.CREATED: frozenset({ProcessState.STARTING, ProcessState.STOPPED}),
    ProcessState.STARTING: frozenset({ProcessState.READY, ProcessState.FAILED, ProcessState.STOPPING}),
    ProcessState.READY: frozenset({ProcessState.STOPPING, ProcessState.FAILED}),
    ProcessState.FAILED: frozenset({ProcessState.STOPPING, ProcessState.STOPPED}),
    ProcessState.STOPPING: frozenset({ProcessState.STOPPED}),
    ProcessState.STOPPED: frozenset(),
}


class EngineStartError(RuntimeError):
    """The server exited or did not become healthy in time; the message carries its log tail."""


class EngineProcess:
    """A server child process with a state machine; `url` is its HTTP base address once started."""

    def __init__(self, name: str, command: CommandFactory, log_path: str, host: str = LOCAL_HOST,
                 pass_socket: bool = False, env: Mapping[str, str] | None = None, port_retries: int = 3,
                 port: int | None = None, api_key: str | None = None, prestarted: Prestarted | None = None) -> None:
        """`port`: listen there (a server others find at a fixed address); None picks a free one per start.
        `api_key`: the key the server asks for, sent with the readiness checks. `prestarted`: a process started
        ahead for this server (`rollout.prestarted`; with `pass_socket`): the first start hands it the argv
        instead of spawning (a later start, or one whose hand-over fails, spawns as usual)."""
        if port is not None and pass_socket:
            raise ValueError("EngineProcess: pass_socket binds a free port; give port= or pass_socket=True, not both")
        self.name = name
        self._command = command
        self.log_path = log_path
        self.host = host
        self._pass_socket = pass_socket
        self._env = dict(env) if env is not None else None
        self._port_retries = port_retries
        self._fixed_port = port
        self._headers = authorization(api_key)
        self._proc: subprocess.Popen | None = None
        # Write end of the pipe whose end-of-file tells the engine's supervisor that this process is gone.
        self._lifeline: int | None = None
        self._state = ProcessState.CREATED
        self.port: int | None = None
        self.failure: str | None = None
        self._prestarted = prestarted if pass_socket else None

    # ---- state -----------------------------------------------------------------------------------------------

    @property
    def state(self) -> ProcessState:
        return self._state

    def _to(self, new: ProcessState) -> None:
        if new not in _TRANSITIONS[self._state]:
            raise RuntimeError(f"engine {self.name}: illegal transition {self._state.value} -> {new.value}")
        self._state = new

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError(f"engine {self.name} has no URL before start()")
        return f"http://{self.host}:{self.port}"

    @property
    def returncode(self) -> int | None:
        return self._proc.poll() if self._proc is not None else None

    def alive(self) -> bool:
        """True while the child runs; a READY engine whose child exited becomes FAILED."""
        running = self._proc is not None and self._proc.poll() is None
        if not running and self._state is ProcessState.READY:
            self.failure = f"exited with code {self.returncode}"
            self._to(ProcessState.FAILED)
        return running

    def log_tail(self, lines: int = 40) -> str:
        """The last `lines` lines of the server log."""
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except FileNotFoundError:
            return "<no log>"

    # ---- start -----------------------------------------------------------------------------------------------

    def start(self) -> None:
        """Spawn the server (non-blocking); then call `wait_ready`."""
        self._to(ProcessState.STARTING)
        self._spawn()

    def _spawn(self) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(self.log_path)), exist_ok=True)
        sock: socket.socket | None = None
        if self._pass_socket:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.host, 0))
            self.port = int(sock.getsockname()[1])
        else:
            self.port = self._fixed_port if self._fixed_port is not None else free_port(self.host)
        fd = sock.fileno() if sock is not None else None
        argv = self._command(self.port, fd)
        if self._adopt(argv, fd):
            assert sock is not None
            sock.close()  # the server received its own copy
            return
        env = {**os.environ, **self._env} if self._env is not None else None
        self._close_lifeline()
        lifeline_read, self._lifeline = os.pipe()
        # The supervisor (stdlib only: -I ignores the engine's PYTHONPATH) stops the server if this process dies.
        supervised = [sys.executable, "-I", lifeline.__file__, str(lifeline_read), "--", *argv]
        try:
            with open(self.log_path, "ab") as log:
                log.write(f"$ {' '.join(argv)}\n".encode())
                log.flush()
                self._proc = subprocess.Popen(supervised, stdout=log, stderr=subprocess.STDOUT,
                                              stdin=subprocess.DEVNULL, start_new_session=True, env=env,
                                              pass_fds=(lifeline_read,) if fd is None else (lifeline_read, fd))
        finally:
            os.close(lifeline_read)  # the supervisor holds its own copy; this process keeps the write end
            if sock is not None:
                sock.close()  # the child holds its own copy

    def _adopt(self, argv: list[str], fd: int | None) -> bool:
        """Hand `argv` and the bound socket to the process started ahead, once; False when there is none."""
        prestarted, self._prestarted = self._prestarted, None
        if prestarted is None:
            return False
        with open(self.log_path, "ab") as log:
            log.write(f"$ {' '.join(argv)}  (started ahead: pid {prestarted.proc.pid})\n".encode())
        try:
            prestarted.hand_over(argv, self.log_path, fd)
        except OSError:  # it ended meanwhile: start a new one
            prestarted.discard()
            return False
        self._close_lifeline()
        self._proc, self._lifeline = prestarted.proc, prestarted.lifeline_fd
        return True

    def _close_lifeline(self) -> None:
        if self._lifeline is not None:
            fd, self._lifeline = self._lifeline, None
            os.close(fd)

    def _health(self, timeout_s: float) -> bool:
        try:
            request = urllib.request.Request(f"{self.url}/health_generate", headers=self._headers)
            with urllib.request.urlopen(request, timeout=timeout_s) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError, TimeoutError):
            return False

    def wait_ready(self, timeout_s: float, poll_interval_s: float = 0.05) -> None:
        """Poll `/health_generate` until 200 (every `poll_interval_s` at first, backing off to 0.5 s); raise
        EngineStartError (with the log tail) on exit or timeout."""
        if self._state is not ProcessState.STARTING:
            raise RuntimeError(f"engine {self.name}: wait_ready in state {self._state.value}")
        deadline = time.monotonic() + timeout_s
        retries = self._port_retries
        while True:
            code = self.returncode
            if code is not None:
                tail = self.log_tail()
                if (retries > 0 and not self._pass_socket and self._fixed_port is None
                        and any(m in tail.lower() for m in _PORT_CLASH)):
                    retries -= 1
                    self._spawn()  # lost a race for the probed port: try a fresh one
                    continue
                self._fail(f"engine {self.name} exited with code {code} during startup; log {self.log_path}:\n{tail}")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._fail(f"engine {self.name} not healthy after {timeout_s:.0f}s (pid {self.pid}); "
                           f"log {self.log_path}:\n{self.log_tail()}")
            if self._health(min(max(remaining, 0.1), 30.0)):
                self._to(ProcessState.READY)
                return
            time.sleep(min(poll_interval_s, max(deadline - time.monotonic(), 0.0)))
            # A small engine is up within seconds: poll often at first, then back off to every 0.5 s.
            poll_interval_s = min(poll_interval_s * 1.5, max(poll_interval_s, 0.5))

    async def wait_ready_async(self, timeout_s: float, poll_interval_s: float = 0.05) -> None:
        """`wait_ready` on a worker thread, for callers on an event loop."""
        await asyncio.to_thread(self.wait_ready, timeout_s, poll_interval_s)

    def _fail(self, message: str) -> None:
        self.failure = message
        self._to(ProcessState.FAILED)
        raise EngineStartError(message)

    # ---- stop ------------------------------------------------------------------------------------------------

    def stop(self, grace_s: float = 10.0) -> int | None:
        """SIGTERM the process group, wait `grace_s`, then SIGKILL whatever is left; returns the exit code."""
        if self._state is ProcessState.STOPPED:
            return self.returncode
        if self._state is ProcessState.CREATED:
            self._to(ProcessState.STOPPED)
            return None
        if self._state is not ProcessState.STOPPING:
            self._to(ProcessState.STOPPING)
        assert self._proc is not None
        pgid = self._proc.pid  # session leader: its pid is the group id
        _signal_group(pgid, signal.SIGTERM)
        try:
            self._proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
        # Children that outlive the leader (or a leader that ignored SIGTERM) are killed.
        _signal_group(pgid, signal.SIGKILL)
        self._proc.wait()
        self._close_lifeline()
        self._to(ProcessState.STOPPED)
        return self._proc.returncode

    async def stop_async(self, grace_s: float = 10.0) -> int | None:
        """`stop` on a worker thread."""
        return await asyncio.to_thread(self.stop, grace_s)


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass
