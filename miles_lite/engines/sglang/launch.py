"""`python -m miles_lite.engines.sglang.launch [--api-key-file FILE] [--insecure] LAUNCH_SERVER_FLAGS...`:
stock SGLang's HTTP server behind the run's API key.

SGLang's own `--api-key` (its API-key middleware) asks for the key on every endpoint except paths starting
with `/health`, `/ready` and `/metrics` (so `/health_generate`, which runs a generation, stays open);
releases with `--admin-api-key` ask for that one instead on the control endpoints (weight updates, flush,
abort, pause) once it is set. Either key would also sit on SGLang's command line and in the server
arguments it prints. So this
launcher reads the key from a file (or the environment), keeps it out of SGLang's arguments, and wraps
SGLang's application in `RequireKey`: every HTTP and WebSocket path but `/health` asks
`Authorization: Bearer KEY`, and a request without it is answered 401 before SGLang sees it.

SGLang's start-up warmup (`/model_info`, then a generation) authenticates with `server_args.api_key`, which
stays unset here: the warmup reads the arguments through a view that adds the key (`launch_server`'s
`execute_warmup_func`, 0.5.17 on). A release without that parameter skips its warmup instead; readiness is
`/health_generate` (a generation) either way.

Before SGLang starts, the launcher also raises the open-files soft limit (`raise_open_files_limit`), turns off
SGLang's crash diagnostics unless the user asks for them (`quiet_engine_stops`), and keeps the trainer's packages
out of the engine's processes (`keep_out_trainer_packages`).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import resource
import signal
import sys
import traceback
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from miles_lite.net.api_key import ApiKeyError, bearer_matches, serving_key

# Paths SGLang serves to anyone: the liveness check (kubelet probes), which takes no input.
OPEN_PATHS = frozenset({"/health"})
LAUNCH_MODULE = "miles_lite.engines.sglang.launch"
# This launcher's own flags, which precede SGLang's: flag -> takes a value.
OWN_FLAGS = {"--api-key-file": True, "--insecure": False}

# The open-files soft limit SGLang's `set_ulimit` asks for; it keeps the old one when the hard limit is lower.
OPEN_FILES_WANTED = 65535
# SGLang (0.5.17: both default true) reads these when its main process takes a child's exit for a crash, then
# sleeps 5 s before a py-spy dump and a CUDA coredump (`TokenizerManager.dump_requests_before_crash`).
CRASH_DIAGNOSTICS_OFF = {"SGLANG_PYSPY_DUMP_BEFORE_CRASH": "0", "SGLANG_CUDA_COREDUMP_BEFORE_CRASH": "0"}

# Packages of the trainer's stack an engine never uses, which SGLang imports where they are installed beside it
# (one image for both roles): its model runner imports its debug dumper, whose Megatron plugin imports
# megatron.core, and with it TransformerEngine, in every engine process at start-up.
NOT_FOR_ENGINES = ("megatron",)

Scope = dict[str, Any]
Asgi = Callable[[Scope, Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]], Awaitable[None]]


class RequireKey:
    """ASGI middleware: 401 (WebSocket: close 1008) unless the request presents `key`; `/health` is open."""

    def __init__(self, app: Asgi, key: str) -> None:
        self.app = app
        self._key = key

    def _allowed(self, scope: Scope) -> bool:
        if scope.get("path") in OPEN_PATHS:
            return True
        header = dict(scope.get("headers") or ()).get(b"authorization")
        return bearer_matches(header.decode("latin-1") if header is not None else None, self._key)

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket") or self._allowed(scope):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        body = json.dumps({"error": "Unauthorized: send the run's API key as 'Authorization: Bearer <key>'"})
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body.encode()})


def split_own_flags(argv: list[str]) -> tuple[list[str], list[str]]:
    """(this launcher's flags, SGLang's flags) of `argv`."""
    own: list[str] = []
    rest: list[str] = []
    i = 0
    while i < len(argv):
        flag = argv[i].split("=", 1)[0]
        if flag in OWN_FLAGS:
            takes = OWN_FLAGS[flag] and "=" not in argv[i]
            own += argv[i:i + 1 + int(takes)]
            i += 1 + int(takes)
        else:
            rest.append(argv[i])
            i += 1
    return own, rest


def raise_open_files_limit(wanted: int = OPEN_FILES_WANTED) -> tuple[int, int]:
    """Raise this process's RLIMIT_NOFILE soft limit to min(hard limit, `wanted`) when it is lower (SGLang's own
    try gives up when `wanted` exceeds the hard limit, leaving e.g. 1024 for a server that holds a descriptor per
    client connection); SGLang's children inherit it. Returns the (soft, hard) limits in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(hard, wanted)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (OSError, ValueError) as exc:  # SGLang still starts, as it would have without this
            print(f"{LAUNCH_MODULE}: could not raise the open-files limit {soft} to {target}: {exc}", file=sys.stderr)
            return soft, hard
        print(f"{LAUNCH_MODULE}: open-files soft limit raised from {soft} to {target} (hard limit {hard})",
              file=sys.stderr)
        soft = target
    return soft, hard


def quiet_engine_stops(environ: MutableMapping[str, str]) -> None:
    """Turn SGLang's crash diagnostics off in `environ` unless set there already. The launcher stops an engine
    by SIGTERM to its process group: SGLang's main process sees its scheduler exit first, takes it for a crash,
    and every engine stop (a run's shutdown, each engine replacement) paid the diagnostics' 5 s pause. A user
    who exports them (e.g. =1) keeps the diagnostics."""
    for name, value in CRASH_DIAGNOSTICS_OFF.items():
        environ.setdefault(name, value)


def keep_out_trainer_packages(modules: MutableMapping[str, Any]) -> None:
    """Make importing `NOT_FOR_ENGINES` fail with ImportError in this process (`modules`: its `sys.modules`), as
    where they are not installed: SGLang's optional users of them (the dumper's plugin) then skip them. Leaves a
    package already imported alone."""
    for name in NOT_FOR_ENGINES:
        if name not in modules:
            modules[name] = None  # `import name` raises ModuleNotFoundError


def main(argv: list[str] | None = None) -> int:
    """Parse, check the key, then run SGLang's server in this process (returns when it stops)."""
    # Before SGLang is imported or starts its children: they inherit both.
    raise_open_files_limit()
    quiet_engine_stops(os.environ)
    own, rest = split_own_flags(list(sys.argv[1:] if argv is None else argv))
    parser = argparse.ArgumentParser(prog=LAUNCH_MODULE, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--api-key-file", default=None, metavar="FILE")
    parser.add_argument("--insecure", action="store_true")
    args = parser.parse_args(own)

    from sglang.srt.entrypoints import http_server
    from sglang.srt.server_args import prepare_server_args

    server_args = prepare_server_args(rest)
    if getattr(server_args, "api_key", None) or getattr(server_args, "admin_api_key", None):
        print(f"{LAUNCH_MODULE}: give the key with --api-key-file (a file), not SGLang's --api-key/--admin-api-key "
              "(the command line is public)", file=sys.stderr)
        return 2
    try:
        key = serving_key(args.api_key_file, server_args.host, args.insecure)
    except ApiKeyError as exc:
        print(f"{LAUNCH_MODULE}: {exc}", file=sys.stderr)
        return 2
    if key is not None:
        if int(getattr(server_args, "tokenizer_worker_num", 1) or 1) > 1:
            print(f"{LAUNCH_MODULE}: tokenizer_worker_num > 1 serves from re-imported applications the key check "
                  "does not wrap; use 1", file=sys.stderr)
            return 2
        http_server.app.add_middleware(RequireKey, key=key)
        return launch_keyed(http_server, server_args, key)
    http_server.launch_server(server_args)
    return 0


class WithKey:
    """`args` as SGLang's warmup reads them, with `api_key` set (SGLang 0.5.17's resolved ServerArgs refuse
    assignment, and the arguments themselves must not hold the key: SGLang logs them)."""

    def __init__(self, args: Any, key: str) -> None:
        self._args = args
        self.api_key = key

    def __getattr__(self, name: str) -> Any:
        return getattr(self._args, name)


def launch_keyed(http_server: Any, server_args: Any, key: str) -> int:
    """Run SGLang's server with its warmup presenting `key` (the arguments SGLang logs never hold it)."""
    if "execute_warmup_func" in inspect.signature(http_server.launch_server).parameters:
        warmup = http_server._execute_server_warmup

        def keyed_warmup(args: Any) -> Any:
            try:
                return warmup(WithKey(args, key))
            except BaseException:
                # SGLang ends the server when its own warmup fails; an error here would otherwise leave it up and
                # never ready (its warmup thread gone) until the launcher's start-up timeout.
                traceback.print_exc()
                os.kill(os.getpid(), signal.SIGKILL)

        http_server.launch_server(server_args, execute_warmup_func=keyed_warmup)
    else:
        server_args.skip_server_warmup = True
        http_server.launch_server(server_args)
    return 0


# The launcher's process, and the children SGLang spawns from it (multiprocessing's spawn runs this module again
# in each, as `__mp_main__`, before anything of SGLang's): not where the driver imports this module.
if __name__ in ("__main__", "__mp_main__"):
    keep_out_trainer_packages(sys.modules)
if __name__ == "__main__":
    sys.exit(main())
