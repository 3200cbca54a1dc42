"""The CPU reference engine: an HF transformers model behind SGLang 0.5.10's HTTP API.

Run as `python -m miles_lite.engines.reference.engine --model-path DIR --port N` (or `miles-lite engine`).
It serves token ids in, token ids + logprobs out, with continuous batching (`scheduler.py`), weight
updates from disk, from serialized tensors and over a torch.distributed group (`server.py`).
`reference_args` of the rollout config map to its flags (`max_batch_size` -> `--max-batch-size`).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket
import sys
from collections.abc import Mapping
from typing import Any

if __name__ == "__main__":  # an engine process: no collections while the libraries load (`net.startup_heap`)
    from miles_lite.net import startup_heap

    startup_heap.pause()

import torch  # noqa: E402
from aiohttp import web  # noqa: E402

from miles_lite.engines.reference.server import FAIL_MODES, ReferenceServer, ServerOptions  # noqa: E402
from miles_lite.net import startup_heap as heap  # noqa: E402
from miles_lite.net.api_key import ENV_KEY, ENV_KEY_FILE, ApiKeyError, serving_key  # noqa: E402
from miles_lite.net.ports import LOCAL_HOST  # noqa: E402

log = logging.getLogger("miles_lite.reference_engine")

# reference_args keys (rollout config) -> (flag, kind); kind "bool" is a bare flag.
REFERENCE_ARGS: dict[str, tuple[str, str]] = {
    "max_batch_size": ("--max-batch-size", "value"),
    "threads": ("--threads", "value"),
    "dtype": ("--dtype", "value"),
    "seed": ("--seed", "value"),
    "weight_version": ("--weight-version", "value"),
    "drop_weight_updates": ("--drop-weight-updates", "bool"),
    "fail_mode": ("--fail-mode", "value"),
    "fail_after": ("--fail-after", "value"),
    "record_requests": ("--record-requests", "value"),
    "return_original_logprob": ("--return-original-logprob", "bool"),
    "group_timeout_s": ("--group-timeout-s", "value"),
    "tp": ("--tp", "value"),
    "custom_weight_loader": ("--custom-weight-loader", "list"),
    "enable_lora": ("--enable-lora", "bool"),
    "max_lora_rank": ("--max-lora-rank", "value"),
    "enable_weights_cpu_backup": ("--enable-weights-cpu-backup", "bool"),
    "max_request_bytes": ("--max-request-bytes", "value"),
    "idle_timeout_s": ("--idle-timeout-s", "value"),
}


def add_reference_arguments(parser: argparse.ArgumentParser, model_required: bool = True) -> None:
    """Add the reference engine's flags to `parser`."""
    parser.add_argument("--model-path", required=model_required,
                        help="HF model directory (config.json + *.safetensors)")
    parser.add_argument("--host", default=LOCAL_HOST)
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--listen-fd", type=int, default=None,
                        help="serve on this inherited, already bound socket instead of host:port")
    parser.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16")
    parser.add_argument("--max-batch-size", type=int, default=64, help="requests decoded together at most")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--seed", type=int, default=0, help="seed of requests without sampling_seed")
    parser.add_argument("--weight-version", default="default")
    parser.add_argument("--drop-weight-updates", action="store_true",
                        help="debug: acknowledge weight updates but keep the old weights")
    parser.add_argument("--fail-mode", default="none", choices=FAIL_MODES,
                        help="fault injection after --fail-after generate requests: hang or answer 500")
    parser.add_argument("--fail-after", type=int, default=0)
    parser.add_argument("--record-requests", default=None, metavar="FILE",
                        help="test: append each finished /generate request (input and output ids) to this JSON-lines "
                             "file")
    parser.add_argument("--return-original-logprob", action="store_true",
                        help="report logprobs before temperature scaling (SGLANG_RETURN_ORIGINAL_LOGPROB=1)")
    parser.add_argument("--group-timeout-s", type=float, default=600.0,
                        help="timeout of the weight-update group rendezvous and collectives")
    parser.add_argument("--tp", type=int, default=1,
                        help="tensor-parallel size: ranks in the weight-update group (rollout.engine_tp)")
    parser.add_argument("--custom-weight-loader", nargs="*", default=[],
                        help="module.function paths a /update_weights_from_tensor load_format may name (as SGLang's)")
    parser.add_argument("--api-key-file", default=None, metavar="FILE",
                        help=f"file (mode 0600) holding the key every request but /health must present as "
                             f"'Authorization: Bearer KEY'; default: ${ENV_KEY_FILE}, then ${ENV_KEY}")
    parser.add_argument("--insecure", action="store_true",
                        help="allow serving a non-loopback address without an API key (anyone who reaches the "
                             "port can generate, pause and replace the weights)")
    parser.add_argument("--enable-lora", action="store_true",
                        help="serve LoRA adapters: /load_lora_adapter, /unload_lora_adapter, lora_path per request")
    parser.add_argument("--max-lora-rank", type=int, default=None, help="refuse adapters of a higher rank")
    parser.add_argument("--enable-weights-cpu-backup", action="store_true",
                        help="keep the weights across /release_memory_occupation (as SGLang's flag); without it "
                             "released weights are lost, and only a weight update after the resume refills them")
    parser.add_argument("--max-request-bytes", type=int, default=0,
                        help="largest request body but weight payloads (413 beyond); 0: what a full batch of the "
                             "model's context needs")
    parser.add_argument("--idle-timeout-s", type=float, default=30.0,
                        help="close connections idle (or sending a body that stalls) for this long")
    parser.add_argument("--log-level", default="INFO")


def engine_key(args: argparse.Namespace) -> str | None:
    """`api_key.serving_key` for parsed engine flags (`--api-key-file`, `--host`, `--insecure`)."""
    return serving_key(args.api_key_file, args.host, args.insecure)


def reference_flags(reference_args: Mapping[str, Any]) -> list[str]:
    """Flags for `rollout.reference_args`; raises ValueError naming an unknown key."""
    flags: list[str] = []
    for key, value in reference_args.items():
        if key not in REFERENCE_ARGS:
            raise ValueError(f"rollout.reference_args.{key} is not a reference engine option; "
                             f"known: {sorted(REFERENCE_ARGS)}")
        flag, kind = REFERENCE_ARGS[key]
        if kind == "bool":
            if not isinstance(value, bool):
                raise ValueError(f"rollout.reference_args.{key} must be true or false, got {value!r}")
            if value:
                flags.append(flag)
        elif kind == "list":
            if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
                raise ValueError(f"rollout.reference_args.{key} must be a list of strings, got {value!r}")
            if value:
                flags += [flag, *value]
        elif value is not None:
            flags += [flag, str(value)]
    return flags


def build_reference_command(model_path: str, port: int, reference_args: Mapping[str, Any],
                            listen_fd: int | None = None, host: str = LOCAL_HOST,
                            python: str = sys.executable, api_key_file: str | None = None) -> list[str]:
    """The command line of one reference engine server listening on `host:port` (or on `listen_fd`);
    `api_key_file`: the path of the key it asks for (the path only: argv is public)."""
    cmd = [python, "-m", "miles_lite.engines.reference.engine", "--model-path", model_path,
           "--host", host, "--port", str(port)]
    if listen_fd is not None:
        cmd += ["--listen-fd", str(listen_fd)]
    if api_key_file is not None:
        cmd += ["--api-key-file", api_key_file]
    return cmd + reference_flags(reference_args)


def make_runner(server: ReferenceServer) -> web.AppRunner:
    """The aiohttp runner of `server`: shutdown aborts every request first, so handlers finish quickly (5 s bound
    stragglers); a connection with no request in flight for `idle_timeout_s` (a client gone without closing,
    or one that never sends a whole request) is closed, and the unread rest of a refused body is discarded for
    at most that long (so the client reads the answer) before the connection closes."""
    idle = server.opts.idle_timeout_s
    return web.AppRunner(server.app, access_log=None, handle_signals=False, shutdown_timeout=5.0,
                         keepalive_timeout=idle, lingering_time=idle)


async def serve(args: argparse.Namespace, api_key: str | None) -> None:
    """Load the model, serve until SIGTERM/SIGINT, then shut down cleanly."""
    torch.set_num_threads(max(1, args.threads))
    torch.manual_seed(args.seed)
    server = ReferenceServer(ServerOptions(
        model_path=args.model_path, dtype=args.dtype, max_batch_size=args.max_batch_size,
        weight_version=args.weight_version, drop_weight_updates=args.drop_weight_updates,
        fail_mode=args.fail_mode, fail_after=args.fail_after, record_requests=args.record_requests,
        return_original_logprob=args.return_original_logprob, group_timeout_s=args.group_timeout_s, tp=args.tp,
        custom_weight_loader=tuple(args.custom_weight_loader), api_key=api_key, enable_lora=args.enable_lora,
        max_lora_rank=args.max_lora_rank, enable_weights_cpu_backup=args.enable_weights_cpu_backup,
        max_request_bytes=args.max_request_bytes, idle_timeout_s=args.idle_timeout_s,
    ))
    runner = make_runner(server)
    await runner.setup()
    if args.listen_fd is not None:
        site: web.BaseSite = web.SockSite(runner, socket.socket(fileno=args.listen_fd))
    else:
        site = web.TCPSite(runner, args.host, args.port)
    await site.start()
    heap.settle()  # loaded and listening: collections resume (the process's own start paused them; CPU only)
    log.info("reference engine serving %s on %s (weight_version=%s, %s)", args.model_path, site.name,
             server.weight_version, "API key required" if api_key else "no API key: open to anyone reaching it")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("reference engine shutting down")
    await runner.cleanup()
    log.info("reference engine stopped")


def run_from_args(args: argparse.Namespace) -> int:
    """Serve with parsed arguments; returns the process exit code."""
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        api_key = engine_key(args)
    except ApiKeyError as exc:
        print(f"miles-lite engine: {exc}", file=sys.stderr)
        return 2
    asyncio.run(serve(args, api_key))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m miles_lite.engines.reference.engine`."""
    parser = argparse.ArgumentParser(prog="miles_lite.engines.reference.engine", description=__doc__)
    add_reference_arguments(parser)
    return run_from_args(parser.parse_args(argv))


def prestart_main(argv: list[str]) -> int:
    """`--prestart-fd FD --prestart-log PATH`: load the libraries, then serve the argv received on FD."""
    from miles_lite.engines.reference.prestart import wait_and_serve

    parser = argparse.ArgumentParser(prog="miles_lite.engines.reference.engine")
    parser.add_argument("--prestart-fd", type=int, required=True)
    parser.add_argument("--prestart-log", required=True)
    args = parser.parse_args(argv)
    return wait_and_serve(args.prestart_fd, args.prestart_log, main)


if __name__ == "__main__":
    code = prestart_main(sys.argv[1:]) if "--prestart-fd" in sys.argv else main()
    from miles_lite.net.process_exit import before_interpreter_exit

    before_interpreter_exit()  # the trainer waits for this process to end when it stops the engine
    sys.exit(code)
