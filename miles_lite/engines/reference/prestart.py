"""A reference engine process started before its run knows its arguments: it loads the libraries meanwhile.

An engine server spends most of its start importing torch and transformers (about 3 s of CPU); the run that
launches it spends about as long on its own imports, its configuration, its data and its trainer before it
can name the engine's model directory, port and key. `miles-lite train` therefore starts each local
reference engine as soon as its configuration is composed:

    python -m miles_lite.engines.reference.engine --prestart-fd FD --prestart-log PATH

The process imports what serving needs, then waits on FD (one end of a `SOCK_SEQPACKET` socket pair) for one
message: the engine's argv and log file as JSON, with the bound listening socket as an attached descriptor.
It then writes to that log (what it printed before goes first) and serves as `python -m ...engine ARGV
--listen-fd <the socket>` would. End of file on FD (the run did not need it, or is gone) ends it quietly. The
launcher side is `rollout.process.EngineProcess(prestarted=...)`; its lifeline supervisor is the usual one.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from collections.abc import Callable
from typing import Any

from miles_lite.rollout.prestarted import PrestartPool

MAX_MESSAGE = 1 << 20
MODULE = "miles_lite.engines.reference.engine"


def prestart_engines(rollout: Any, python: str = sys.executable) -> PrestartPool | None:
    """Reference engine processes started ahead for the `rollout.engines` engines a job will launch (a
    `RolloutConfig`); None when its engines are SGLang's or started elsewhere. Imports nothing heavy: the
    command line calls it before it loads torch."""
    if rollout.backend != "reference" or rollout.engine_urls or rollout.engines < 1:
        return None
    env = {str(k): str(v) for k, v in rollout.engine_env.items()}
    return PrestartPool.spawn(rollout.engines, [python, "-m", MODULE], env)


def preload() -> None:
    """What every served model needs, imported ahead: transformers' model machinery and tokenizers."""
    import transformers.modeling_utils  # noqa: F401 - the bulk of a model class's import
    import transformers.models.auto.modeling_auto  # noqa: F401
    from transformers import AutoTokenizer  # noqa: F401


def wait_and_serve(control_fd: int, early_log: str, main: Callable[[list[str]], int]) -> int:
    """Preload, wait for the engine's argv on `control_fd`, then run `main(argv)` writing to its log."""
    preload()
    control = socket.socket(fileno=control_fd)
    try:
        message, fds, _, _ = socket.recv_fds(control, MAX_MESSAGE, 1)
    except OSError:
        message, fds = b"", []
    finally:
        control.close()
    if not message:  # the run went on without this engine, or ended
        _remove(early_log)
        return 0
    spec = json.loads(message)
    _write_to(spec["log"], early_log)
    return main(server_args(spec["argv"], fds[0] if fds else None))


def server_args(argv: list[str], listen_fd: int | None) -> list[str]:
    """The engine's own flags from the command the launcher built (`python -m <module> FLAGS`), listening on
    the descriptor received here rather than the launcher's number for it."""
    args = argv[argv.index("-m") + 2:] if "-m" in argv[:3] else list(argv)
    out: list[str] = []
    skip = False
    for arg in args:
        if skip:
            skip = False
        elif arg == "--listen-fd":
            skip = True
        elif not arg.startswith("--listen-fd="):
            out.append(arg)
    return out + (["--listen-fd", str(listen_fd)] if listen_fd is not None else [])


def _write_to(log_path: str, early_log: str) -> None:
    """Send stdout and stderr to `log_path` (appending), after what was written to `early_log` so far."""
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        with open(early_log, "rb") as early:
            os.write(fd, early.read())
    except OSError:
        pass
    _remove(early_log)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
