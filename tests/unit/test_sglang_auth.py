"""The key check wrapped around SGLang's application (`engines.sglang.launch.RequireKey`), on a stand-in ASGI app,
and the launcher's own flags kept apart from SGLang's."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from typing import Any

from miles_lite.engines.sglang.command import build_sglang_command
from miles_lite.engines.sglang.launch import LAUNCH_MODULE, RequireKey, launch_keyed, split_own_flags
from miles_lite.net.api_key import authorization, new_key

KEY = new_key()


def _ask(scope_type: str, path: str, headers: dict[str, str]) -> tuple[list[dict[str, Any]], list[str]]:
    reached: list[str] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        reached.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b""}

    scope = {"type": scope_type, "path": path,
             "headers": [(k.lower().encode(), v.encode("latin-1")) for k, v in headers.items()]}
    asyncio.run(RequireKey(app, KEY)(scope, receive, send))
    return sent, reached


def test_every_path_but_health_needs_the_key() -> None:
    for path in ("/generate", "/health_generate", "/metrics", "/ready", "/update_weights_from_disk",
                 "/v1/chat/completions", "/get_server_info", "/unknown"):
        for headers in ({}, authorization(new_key()), {"Authorization": KEY}):
            sent, reached = _ask("http", path, headers)
            assert sent[0]["status"] == 401 and not reached, (path, headers)
        sent, reached = _ask("http", path, authorization(KEY))
        assert sent[0]["status"] == 200 and reached == [path]
    sent, reached = _ask("http", "/health", {})
    assert sent[0]["status"] == 200 and reached == ["/health"]


def test_websockets_without_the_key_are_closed() -> None:
    sent, reached = _ask("websocket", "/v1/realtime", {})
    assert sent == [{"type": "websocket.close", "code": 1008}] and not reached


def test_key_file_path_not_key_reaches_the_command_line(tmp_path) -> None:
    cmd = build_sglang_command("/m", 30000, 1, {"skip_tokenizer_init": True}, api_key_file="/run/key")
    assert cmd[1:3] == ["-m", LAUNCH_MODULE] and cmd[cmd.index("--api-key-file") + 1] == "/run/key"
    own, rest = split_own_flags(cmd[3:])
    assert own == ["--api-key-file", "/run/key"] and "--api-key-file" not in rest and "--skip-tokenizer-init" in rest
    assert split_own_flags(["--insecure", "--port", "1", "--api-key-file=/k"]) == (
        ["--insecure", "--api-key-file=/k"], ["--port", "1"])


def test_sglang_api_key_flags_are_refused() -> None:
    import pytest

    for flag in ("api_key", "admin-api-key"):
        with pytest.raises(ValueError, match="cluster.api_key_file"):
            build_sglang_command("/m", 1, 1, {flag: "secret"})


class _Args:
    api_key = None
    skip_server_warmup = False
    port = 30000

    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


class _ResolvedArgs(_Args):
    """Like SGLang 0.5.17's resolved ServerArgs: read-only."""

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"server_args.{name} assigned after resolution")


class _WarmupServer:
    """Stand-in for SGLang's `http_server` module: `launch_server` runs the warmup it is given, as SGLang does."""

    def __init__(self) -> None:
        self.warmed_with: list[Any] = []

    def _execute_server_warmup(self, args: Any) -> bool:
        self.warmed_with.append((args.api_key, args.url()))
        return True

    def launch_server(self, server_args: Any, execute_warmup_func: Any = None) -> None:
        (execute_warmup_func or self._execute_server_warmup)(server_args)


class _OldServer:
    """A release whose `launch_server` takes no warmup function."""

    def __init__(self) -> None:
        self.launched: list[Any] = []

    def launch_server(self, server_args: Any) -> None:
        self.launched.append(server_args)


def test_the_warmup_presents_the_key_and_the_logged_arguments_never_hold_it() -> None:
    server, args = _WarmupServer(), _ResolvedArgs()
    assert launch_keyed(server, args, KEY) == 0
    assert server.warmed_with == [(KEY, "http://127.0.0.1:30000")]
    assert args.api_key is None and not args.skip_server_warmup


def test_a_release_without_a_warmup_hook_skips_its_warmup_rather_than_fail_it() -> None:
    server, args = _OldServer(), _Args()
    launch_keyed(server, args, KEY)
    assert server.launched == [args] and args.skip_server_warmup and args.api_key is None


def test_a_failing_keyed_warmup_ends_the_server_at_once() -> None:
    # SGLang runs the warmup on a thread of the server process: were it to die there, the server would stay up
    # and never ready. A child process plays that server.
    code = """
import threading
from miles_lite.engines.sglang.launch import launch_keyed

class Args:
    api_key = None

class Server:
    def _execute_server_warmup(self, args):
        raise RuntimeError("warmup broke: " + str(args.api_key is not None))
    def launch_server(self, server_args, execute_warmup_func=None):
        threading.Thread(target=execute_warmup_func, args=(server_args,)).start()
        threading.Event().wait(60)

launch_keyed(Server(), Args(), "k" * 43)
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert "warmup broke: True" in proc.stderr
