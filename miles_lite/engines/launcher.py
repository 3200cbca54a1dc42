"""`EngineLauncher`: start and stop engine i of the configured kind; the fleet calls it to replace dead engines.

Both kinds are server processes speaking SGLang's HTTP API, launched through `EngineProcess` and reached
through `HttpEngine`; they differ only in the command line:

- `reference`: `python -m miles_lite.engines.reference.engine`, on a socket the launcher binds (no port race),
  `rollout.reference_args` as flags, `--tp` from `rollout.engine_tp`, and a distinct sampling seed per engine index;
- `sglang`: `python -m sglang.launch_server` with `rollout.sglang_args` passed through, `--tp-size` from
  `rollout.engine_tp`, and `--base-gpu-id index * engine_tp` unless `sglang_args` sets `base_gpu_id` (on a Ray
  placement group each engine sees only its own GPUs: set `base_gpu_id: 0` there).

Both get the project's weight-loader plugin (`--custom-weight-loader`, what `weight_sync.mode=shard`
pushes through); SGLang processes also get the project root appended to PYTHONPATH, so that SGLang
installed apart (its own torch first on the path) can import the plugin. SGLang engines started with
`enable_memory_saver` get their environment without `expandable_segments` (`config.colocation`).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from miles_lite.config.colocation import ALLOC_CONF_VARS, memory_saver_env, memory_saver_on
from miles_lite.config.schema import RolloutConfig
from miles_lite.engines.reference.engine import build_reference_command
from miles_lite.engines.sglang.command import (
    build_sglang_command,
    check_flags_known,
    check_sglang_command,
    for_installed_sglang,
    plugin_env,
    probe_sglang_option_names,
    with_weight_loader,
)
from miles_lite.net.api_key import ApiKey
from miles_lite.net.ports import LOCAL_HOST
from miles_lite.rollout.http_client import HttpEngine
from miles_lite.rollout.prestarted import PrestartPool
from miles_lite.rollout.process import CommandFactory, EngineProcess

BACKENDS = ("reference", "sglang")
log = logging.getLogger(__name__)


def served_vocab_size(model_path: str) -> int | None:
    """The vocabulary size an engine serving `model_path` uses (config.json's, its text model's for a
    multimodal config, as SGLang reads it); None when config.json does not say."""
    try:
        with open(os.path.join(model_path, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    size = text.get("vocab_size", config.get("vocab_size"))
    return int(size) if isinstance(size, int) and size > 0 else None


@dataclass
class LaunchedEngine:
    """A started engine: its process (lifecycle) and its client (the RolloutEngine)."""

    index: int
    process: EngineProcess
    client: HttpEngine


class EngineLauncher:
    """Builds, starts and stops engine servers for one rollout configuration."""

    def __init__(self, rollout: RolloutConfig, model_path: str, log_dir: str, host: str = LOCAL_HOST,
                 python: str = sys.executable, env: Mapping[str, str] | None = None,
                 api_key: ApiKey | None = None, prestarted: PrestartPool | None = None) -> None:
        """`api_key`: the run's key; engines read it from its file and the clients send it. None: open engines
        (allowed on loopback only; the engine refuses another address without a key). `prestarted`: reference
        engine processes started ahead (`reference.prestart.prestart_engines`), taken by the first start of each
        index."""
        if rollout.backend not in BACKENDS:
            raise ValueError(f"rollout.backend={rollout.backend!r} is not one of {BACKENDS}")
        if not model_path or not os.path.isdir(model_path):
            raise ValueError(f"engine model path {model_path!r} is not a directory; set model.hf_path or save the "
                             "initial weights as an HF directory first")
        self.rollout = rollout
        self.model_path = model_path
        self.log_dir = log_dir
        self.host = host
        self.python = python
        self.env = dict(env) if env is not None else None
        self.api_key = api_key
        self._attempts: dict[int, int] = {}
        self.vocab_size = served_vocab_size(model_path)
        self._sglang_options: tuple[frozenset[str] | None] | None = None  # asked of the engines' SGLang once
        self.prestarted = prestarted if rollout.backend == "reference" else None

    def sglang_options(self) -> frozenset[str] | None:
        """The installed SGLang's launch flags, as the engines' interpreter and environment see them."""
        if self._sglang_options is None:
            env = plugin_env(os.environ if self.env is None else {**os.environ, **self.env})
            self._sglang_options = (probe_sglang_option_names(self.python, env),)
        return self._sglang_options[0]

    @property
    def key_value(self) -> str | None:
        """The key the engines ask for (None: none)."""
        return self.api_key.value if self.api_key is not None else None

    def engine_id(self, index: int) -> str:
        """The id of engine `index` (stable across replacements)."""
        return f"{self.rollout.backend}-{index}"

    def command_factory(self, index: int) -> CommandFactory:
        """(port, inherited socket fd) -> argv of engine `index`; validates the configuration up front."""
        key_file = str(self.api_key.path) if self.api_key is not None else None
        if self.rollout.backend == "reference":
            args = dict(self.rollout.reference_args)
            args["custom_weight_loader"] = with_weight_loader(args.get("custom_weight_loader"))
            args.setdefault("seed", index)
            # One source of truth for the engine's TP: rollout.engine_tp, as for SGLang's --tp-size.
            if args.setdefault("tp", self.rollout.engine_tp) != self.rollout.engine_tp:
                raise ValueError(f"rollout.reference_args.tp={args['tp']} differs from rollout.engine_tp="
                                 f"{self.rollout.engine_tp}; set only rollout.engine_tp")
            build_reference_command(self.model_path, 0, args, python=self.python)  # raises on bad keys now

            def reference(port: int, fd: int | None) -> list[str]:
                return build_reference_command(self.model_path, port, args, listen_fd=fd, host=self.host,
                                               python=self.python, api_key_file=key_file)

            return reference
        known = self.sglang_options()
        args = for_installed_sglang(self.rollout.sglang_args, known)
        args["custom_weight_loader"] = with_weight_loader(args.get("custom_weight_loader"))
        args.setdefault("base_gpu_id", index * self.rollout.engine_tp)
        probe_cmd = build_sglang_command(self.model_path, 0, self.rollout.engine_tp, args, python=self.python)
        if known is not None:  # the engines' own SGLang (it may be installed apart from this process's)
            check_flags_known(probe_cmd, known)
        else:
            check_sglang_command(probe_cmd)

        def sglang(port: int, fd: int | None) -> list[str]:
            return build_sglang_command(self.model_path, port, self.rollout.engine_tp, args, host=self.host,
                                        python=self.python, api_key_file=key_file)

        return sglang

    def create(self, index: int, attempt: int | None = None) -> EngineProcess:
        """A not-yet-started process for engine `index`, logging to `log_dir/<id>.<attempt>.log`.

        `attempt`: the log's number (default: one more than this launcher's last for `index`).
        """
        attempt = self._attempts.get(index, 0) if attempt is None else attempt
        self._attempts[index] = attempt + 1
        log_path = os.path.join(self.log_dir, f"{self.engine_id(index)}.{attempt}.log")
        env = self.env
        if self.rollout.backend == "sglang":
            env = plugin_env(os.environ if env is None else {**os.environ, **env})
            if memory_saver_on(self.rollout):
                kept = memory_saver_env(env)
                dropped = [f"{v}={env[v]!r}" for v in ALLOC_CONF_VARS if env.get(v) != kept.get(v)]
                if dropped:
                    log.warning("%s: starting without expandable_segments (%s): SGLang's memory saver does not work "
                                "with it", self.engine_id(index), ", ".join(dropped))
                env = kept
        ahead = self.prestarted.take(index) if self.prestarted is not None and attempt == 0 else None
        return EngineProcess(self.engine_id(index), self.command_factory(index), log_path, host=self.host,
                             pass_socket=self.rollout.backend == "reference", env=env, api_key=self.key_value,
                             prestarted=ahead)

    async def start(self, index: int) -> LaunchedEngine:
        """Start engine `index` and wait until it generates; raises EngineStartError with the log tail."""
        process = self.create(index)
        process.start()
        try:
            await process.wait_ready_async(self.rollout.startup_timeout_s)
        except BaseException:
            await process.stop_async()
            raise
        # Reference engines take the step's requests as one batched /generate (measured on SGLang: not yet).
        client = HttpEngine(self.engine_id(index), process.url, request_timeout_s=self.rollout.request_timeout_s,
                            vocab_size=self.vocab_size, api_key=self.key_value,
                            batch_generate=self.rollout.backend == "reference")
        return LaunchedEngine(index, process, client)

    async def stop(self, engine: LaunchedEngine, grace_s: float = 10.0) -> int | None:
        """Close the client and stop the server's process group; returns its exit code."""
        await engine.client.close()
        return await engine.process.stop_async(grace_s)
