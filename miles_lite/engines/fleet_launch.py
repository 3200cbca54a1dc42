"""Wire `EngineLauncher` (engine server processes) into `EngineFleet` (lifecycle and replacement), and
`build_rollout`: the rollout side of a job (event-loop thread, fleet, manager), the same for training,
presampling and evaluation."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles_lite.config.schema import FaultToleranceConfig, RolloutConfig
from miles_lite.config.views import EngineFleetConfig
from miles_lite.data.encoding import PromptEncoder
from miles_lite.engines.engine_list import EngineListFollower, EngineUnlisted, read_engine_list
from miles_lite.engines.launcher import EngineLauncher
from miles_lite.engines.process_stacks import dead_engine_title, stacks_path, stacks_report
from miles_lite.formats.chat import resolve_chat_template
from miles_lite.formats.files import write_atomic
from miles_lite.net.api_key import ApiKey
from miles_lite.plugins import PluginPool, load_sync_fn
from miles_lite.rollout.agent_slots import AgentSlots, start_agent_slots, stop_agent_slots
from miles_lite.rollout.environment import load_environment
from miles_lite.rollout.fleet import EngineFleet, EngineHandle, Launcher
from miles_lite.rollout.generate_plugin import load_generate_fn
from miles_lite.rollout.http_client import HttpEngine
from miles_lite.rollout.manager import RolloutManager
from miles_lite.rollout.prestarted import PrestartPool
from miles_lite.rollout.routing import RoutingLayout
from miles_lite.rollout.sync_api import EventLoopThread, SyncRolloutManager

logger = logging.getLogger(__name__)


def fleet_launcher(launcher: EngineLauncher, stop_grace_s: float = 10.0) -> Launcher:
    """The fleet's `launcher(index, incarnation)` over `EngineLauncher.start/stop`.

    The handle's `pid` is the server process (what a fault-injection test SIGKILLs); `stop` ends
    its whole process group; `diagnose` writes its processes' stacks beside its log (`stacks_path`).
    """

    async def launch(index: int, incarnation: int) -> EngineHandle:
        launched = await launcher.start(index)

        async def stop() -> None:
            await launcher.stop(launched, stop_grace_s)

        async def diagnose(why: str) -> Path | None:
            pid = launched.process.pid
            if pid is None:
                return None
            title = dead_engine_title(launched.client.engine_id, index, incarnation, why)
            return write_atomic(stacks_path(launched.process.log_path), await stacks_report(pid, title))

        return EngineHandle(launched.client, stop=stop, pid=launched.process.pid, diagnose=diagnose)

    return launch


async def populate(fleet: EngineFleet, fill: Awaitable[object], health_checks: bool = True) -> EngineFleet:
    """Await `fill` (launching or attaching the fleet's engines); on any failure stop the engines already up
    and re-raise. Then start the periodic health checks if asked. Returns the fleet."""
    try:
        await fill
    except BaseException:
        await fleet.close()
        raise
    if health_checks:
        fleet.start_health_checks()
    return fleet


async def start_fleet(
    rollout: RolloutConfig,
    ft: FaultToleranceConfig,
    model_path: str,
    log_dir: str,
    *,
    engines: int | None = None,
    health_checks: bool = True,
    api_key: ApiKey | None = None,
    prestarted: PrestartPool | None = None,
) -> EngineFleet:
    """Start `engines` (default `rollout.engines`) servers of `rollout.backend` as one fleet.

    The fleet owns the servers: `await fleet.close()` stops them all. They ask for `api_key` (None: open, on
    loopback only). With `health_checks`, the
    periodic health task runs from the start. If a server fails to start, the ones already up
    are stopped before the error propagates.
    """
    n = rollout.engines if engines is None else engines
    if n < 1:
        raise ValueError(f"rollout.engines must be >= 1, got {n}")
    launcher = EngineLauncher(rollout, model_path, log_dir, env={str(k): str(v) for k, v in rollout.engine_env.items()},
                              api_key=api_key, prestarted=prestarted)
    fleet = EngineFleet(ft, fleet_launcher(launcher),
                        max_inflight_per_engine=rollout.max_inflight_per_engine)
    return await populate(fleet, fleet.launch(n), health_checks)


async def await_engine(rollout: RolloutConfig, index: int, url: str, what: str, poll_s: float = 1.0,
                       vocab_size: int | None = None, api_key: str | None = None,
                       wanted: Callable[[], bool] | None = None) -> HttpEngine:
    """A client of engine `index` at `url` once it answers its health check, polled every `poll_s` for up to
    `rollout.startup_timeout_s` (then TimeoutError naming the engine, `what` it was awaited for and the field).
    `vocab_size`: the served model's (see `HttpEngine`); `api_key`: the run's key, sent with every request;
    `wanted`: asked before each poll; False ends the wait with EngineUnlisted (the engine was scaled away)."""
    engine = HttpEngine(f"engine-{index}", url.rstrip("/"), request_timeout_s=rollout.request_timeout_s,
                        vocab_size=vocab_size, api_key=api_key)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + rollout.startup_timeout_s
    while not await engine.health(timeout_s=min(5.0, rollout.startup_timeout_s)):
        if wanted is not None and not wanted():
            await engine.close()
            raise EngineUnlisted(f"engine-{index} at {url} was removed from the engine list {what}")
        if loop.time() > deadline:
            await engine.close()
            raise TimeoutError(f"engine-{index} at {url} did not answer /health_generate within "
                               f"rollout.startup_timeout_s={rollout.startup_timeout_s}s {what}")
        await asyncio.sleep(poll_s)  # the poll period between health checks
    return engine


def reattach_launcher(rollout: RolloutConfig, urls: list[str], poll_s: float = 1.0,
                      vocab_size: int | None = None, api_key: str | None = None,
                      wanted: Callable[[str], bool] | None = None) -> Launcher:
    """The fleet's `launcher(index, incarnation)` for engines started elsewhere: the replacement of a dead
    engine is whatever answers at its URL again (the operator recreates a failed engine pod under the same
    DNS name), awaited for up to `rollout.startup_timeout_s`. The fleet then admits it as stale, and the
    next weight push brings it to the current version. Stopping it is not this process's business.
    """

    async def launch(index: int, incarnation: int) -> EngineHandle:
        url = urls[index]
        still = None if wanted is None else (lambda: wanted(url))
        return EngineHandle(await await_engine(rollout, index, url, "after it died", poll_s, vocab_size, api_key,
                                                 still))

    return launch


async def attach_fleet(rollout: RolloutConfig, ft: FaultToleranceConfig, urls: list[str], *,
                       health_checks: bool = True, poll_s: float = 1.0,
                       vocab_size: int | None = None, api_key: str | None = None,
                       wanted: Callable[[str], bool] | None = None) -> EngineFleet:
    """A fleet of engines started elsewhere (`rollout.engine_urls`, e.g. pods of the Kubernetes operator).

    Engines that do not answer yet are awaited (up to `rollout.startup_timeout_s` each, concurrently): pods
    start in any order, and an engine still loading is starting, not dead. The fleet does not own these
    servers: it health-checks them and stops routing to dead ones; whoever started them replaces them (the
    operator recreates failed engine pods), and the fleet re-admits an engine whose URL answers again
    (`reattach_launcher`), up to `fault_tolerance.max_engine_restarts`.
    """
    fleet = EngineFleet(ft, reattach_launcher(rollout, urls, poll_s, vocab_size, api_key, wanted),
                        max_inflight_per_engine=rollout.max_inflight_per_engine)

    async def attach_all() -> None:
        answered = await asyncio.gather(*(await_engine(rollout, i, url, "at start", poll_s, vocab_size, api_key)
                                          for i, url in enumerate(urls)), return_exceptions=True)
        errors = [e for e in answered if isinstance(e, BaseException)]
        if errors:
            await asyncio.gather(*(e.close() for e in answered if isinstance(e, HttpEngine)))
            raise errors[0]
        for engine in answered:
            await fleet.add_engine(EngineHandle(engine))

    return await populate(fleet, attach_all(), health_checks)


async def follow_engine_list(fleet_urls: list[str], rollout: RolloutConfig, ft: FaultToleranceConfig,
                             path: str, *, vocab_size: int | None = None,
                             api_key: str | None = None) -> tuple[EngineFleet, EngineListFollower]:
    """Attach the engines the list in `path` names (else those of `rollout.engine_urls`), then follow the list (the
    fleet grows and shrinks with it; see engine_list.py). Call on the fleet's loop."""
    follower: EngineListFollower | None = None
    listed = read_engine_list(path)
    if listed:
        # The list as it stands now: the operator leaves out engines it cannot schedule, which would never answer.
        fleet_urls[:] = listed

    def wanted(url: str) -> bool:
        return follower is None or follower.still_listed(url)

    fleet = await attach_fleet(rollout, ft, fleet_urls, vocab_size=vocab_size, api_key=api_key, wanted=wanted)

    async def connect(index: int, url: str, still: Callable[[], bool]) -> HttpEngine:
        return await await_engine(rollout, index, url, "after it was added", vocab_size=vocab_size, api_key=api_key,
                                  wanted=still)

    follower = EngineListFollower(fleet, connect, fleet_urls, path, poll_s=ft.health_interval_s)
    follower.start()
    return fleet, follower


@dataclass
class Rollout:
    """A started rollout side: the event-loop thread, the fleet living on it, and the blocking manager;
    `own_key`: a key this object made for its engines, removed at `close`."""

    loop: EventLoopThread
    fleet: EngineFleet
    manager: SyncRolloutManager
    own_key: ApiKey | None = None
    follower: EngineListFollower | None = None
    # The agent plug-in's gateway and runner (`rollout.agent`), or None.
    agents: AgentSlots | None = None

    def close(self) -> None:
        """Stop the gateway, the engines (those this job started), then the loop; the loop stops even if the fleet
        fails to."""
        try:
            if self.agents is not None:
                agents, self.agents = self.agents, None
                self.loop.run(stop_agent_slots(agents))
            if self.follower is not None:
                self.loop.run(self.follower.stop())
            self.loop.run(self.fleet.close())
        finally:
            try:
                self.loop.stop()
            finally:
                if self.own_key is not None:
                    self.own_key.close()


def _routing_layout(model_path: str | None) -> RoutingLayout | None:
    """The MoE routing layout of the served model when samples carry routing (always for MoE models: the
    trainer reports `moe/router_agreement` with replay on or off)."""
    config = Path(str(model_path)) / "config.json"
    if not model_path or not config.is_file():
        return None
    return RoutingLayout.of_config(json.loads(config.read_text()))


def chat_template_of(cfg: EngineFleetConfig, tokenizer: Any) -> Any:
    """The run's chat template (`rollout.chat_template`), checked append-only on `tokenizer` (a failing `hf`
    template raises ValueError; a failing project family is used, with a warning logged)."""
    template, warning = resolve_chat_template(
        cfg.rollout.chat_template, tokenizer, cfg.model_arch, tiny=cfg.tiny_model,
        tokenize=lambda text: list(tokenizer(text, add_special_tokens=False)["input_ids"]))
    if warning:
        logger.warning("%s", warning)
    return template


def build_rollout(cfg: EngineFleetConfig, tokenizer: Any, log_dir: str, *, seed: int | None = None,
                  start: Callable[[], Awaitable[EngineFleet]] | None = None,
                  api_key: ApiKey | None = None, plugins: PluginPool | None = None,
                  chat_template: Any = None, prestarted: PrestartPool | None = None) -> Rollout:
    """Start (or, with `rollout.engine_urls`, attach) the fleet of `model.hf_path` on a new event-loop thread,
    with a manager decoding and stopping with `tokenizer`; `seed` seeds the manager's sampling seeds.
    `start`: the coroutine that starts the fleet instead (the engines of a Ray rollout gang).
    `api_key`: the run's key; None: `ApiKey.for_run(cluster.api_key_file)`, owned by the returned Rollout.
    `plugins`: the pool blocking plug-in calls run in (default: the manager's own threads). With `rollout.agent`
    the session gateway starts too, rendering with `chat_template` (default: `chat_template_of`).
    `prestarted`: engine processes started ahead (`engines.reference.prestart.prestart_engines`) for the launched
    engines."""
    if cfg.rollout.agent and chat_template is None:
        chat_template = chat_template_of(cfg, tokenizer)
    own_key = ApiKey.for_run(cfg.cluster.api_key_file) if api_key is None else None
    key = api_key if api_key is not None else own_key
    loop = EventLoopThread().start()
    follower = None
    try:
        rollout, ft = cfg.rollout, cfg.fault_tolerance
        if start is not None:
            fleet = loop.run(start())
        elif rollout.engine_urls and rollout.engine_urls_file:
            # Engines started elsewhere whose set may change while this job runs (operator-managed pods).
            fleet, follower = loop.run(follow_engine_list([u.rstrip("/") for u in rollout.engine_urls], rollout, ft,
                                                          rollout.engine_urls_file,
                                                          vocab_size=cfg.vocab_size, api_key=key.value))
        elif rollout.engine_urls:
            # Engines started elsewhere (e.g. operator-managed pods): attach, do not launch.
            fleet = loop.run(attach_fleet(rollout, ft, list(rollout.engine_urls),
                                          vocab_size=cfg.vocab_size, api_key=key.value))
        else:
            fleet = loop.run(start_fleet(rollout, ft, str(cfg.model_path), log_dir, api_key=key,
                                         prestarted=prestarted))
    except BaseException:
        loop.stop()
        if own_key is not None:
            own_key.close()
        raise
    encoder = PromptEncoder(tokenizer)
    # Plug-ins (checked at start by config validation): a tool environment (multi-turn), a generate function,
    # dynamic sampling's group filter.
    environment = load_environment(rollout.environment) if rollout.environment else None
    generate_fn = load_generate_fn(rollout.generate_fn) if rollout.generate_fn else None
    group_filter = load_sync_fn(rollout.group_filter, "rollout.group_filter", 1) if rollout.group_filter else None
    manager = RolloutManager(fleet, rollout, ft, decode=encoder.decode, stop_token_ids=encoder.stop_token_ids,
                             seed=seed, encode=encoder.encode, environment=environment, generate_fn=generate_fn,
                             group_filter=group_filter, routing=_routing_layout(cfg.model_path), plugins=plugins)
    built = Rollout(loop, fleet, SyncRolloutManager(manager, loop), own_key, follower)
    if rollout.agent:
        try:
            built.agents = loop.run(start_agent_slots(
                manager, rollout, chat_template, encoder.encode, lambda ids: tokenizer.decode(ids), key.value,
                cfg.model_name))
        except BaseException:
            built.close()
            raise
    return built
