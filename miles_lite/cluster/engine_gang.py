"""The rollout role on Ray: its gang (placement group) and one engine actor per bundle.

`RolloutGang.reserve(fleet_cfg, ...)` reserves the rollout gang, all bundles or none (one bundle per engine,
each asking `cluster.cpus_per_engine` CPUs, `engine_gpus * engine_tp` GPUs and one unit of
`cluster.rollout_resource`), or, when colocated, reuses the trainer's placement group. `launch(slot,
incarnation)` is the fleet's launcher: it places an `EngineServer` actor in bundle `slot` (a
replacement lands in the same bundle, hence on a node of the gang), waits until its server generates
and hands the fleet a client dialing `http://<node address>:<port>`. Every placement is logged and
appended to `<log_dir>/engines.jsonl`, so a run shows which node each engine ran on.

Lifecycle: RESERVED -> CLOSED. A bundle whose node died is placed again by Ray where the gang has
room; when there is none, the launch times out, the fleet counts the failed restart and the run goes
on with the engines it has.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import json
import logging
import time
from pathlib import Path
from typing import Any

from miles_lite.cluster.engine_actor import EngineLocation, EngineServer
from miles_lite.cluster.gang import GangSpec, reserve, rollout_gang
from miles_lite.config.views import EngineFleetConfig
from miles_lite.engines.fleet_launch import populate
from miles_lite.engines.process_stacks import dead_engine_title
from miles_lite.formats.files import append_line, write_atomic
from miles_lite.rollout.engine import EngineError
from miles_lite.rollout.engine_state import EngineHandle
from miles_lite.rollout.fleet import EngineFleet
from miles_lite.rollout.http_client import HttpEngine
from miles_lite.rollout.process import EngineStartError

logger = logging.getLogger(__name__)

# Seconds an actor gets to answer a liveness question before the engine counts as unreachable.
ACTOR_CALL_TIMEOUT_S = 30.0


class GangState(enum.Enum):
    RESERVED = "reserved"
    CLOSED = "closed"


class GangEngine(HttpEngine):
    """An engine's HTTP client whose health check first asks the engine's actor about the process.

    A server that exited (SIGKILL, OOM) or an actor that is gone (its node died) fails the check at
    once, with the reason, instead of after an HTTP timeout.
    """

    def __init__(self, location: EngineLocation, actor: Any, request_timeout_s: float,
                 api_key: str | None = None, vocab_size: int | None = None) -> None:
        super().__init__(location.engine_id, location.url, request_timeout_s=request_timeout_s, api_key=api_key,
                         vocab_size=vocab_size)
        self.location = location
        self.actor = actor

    async def health(self, timeout_s: float) -> bool:
        try:
            code = await asyncio.wait_for(asyncio.wrap_future(self.actor.returncode.remote().future()), timeout_s)
        except Exception as exc:  # the actor died or its node is unreachable
            raise EngineError(f"{self.engine_id}: its actor on {self.location.node_address} does not answer "
                              f"({type(exc).__name__}: {exc})") from exc
        if code is not None:
            raise EngineError(f"{self.engine_id}: server process {self.location.pid} on "
                              f"{self.location.node_address} exited with code {code}")
        return await super().health(timeout_s)


class RolloutGang:
    """The rollout engines' placement group and the engine actors placed in it."""

    def __init__(self, cfg: EngineFleetConfig, log_dir: str, placement_group: Any,
                 bundles: tuple[dict[str, float], ...], owns_group: bool) -> None:
        self.cfg = cfg
        # The run's key (`start_gang_fleet` sets it): each engine actor gets it as a call argument, never argv.
        self.api_key: str | None = None
        self.log_dir = log_dir
        self.placement_group = placement_group
        self.bundles = bundles
        self.owns_group = owns_group
        self.state = GangState.RESERVED
        self.actors: dict[int, Any] = {}
        self.locations: list[EngineLocation] = []

    @classmethod
    def reserve(cls, cfg: EngineFleetConfig, log_dir: str, trainer_group: Any = None,
                trainer_bundles: tuple[dict[str, float], ...] = ()) -> RolloutGang:
        """Reserve the rollout gang (or share the trainer's when colocated); raises `GangSchedulingError`."""
        spec = rollout_gang(cfg.rollout, cfg.cluster)
        if spec is None:
            if trainer_group is None:
                raise ValueError("cluster.placement=colocated places engines in the trainer's gang: start the "
                                 "trainer on Ray first (cluster.mode=ray)")
            return cls(cfg, log_dir, trainer_group, trainer_bundles, owns_group=False)
        held = (GangSpec("trainer", trainer_bundles),) if trainer_bundles else ()
        return cls(cfg, log_dir, reserve(spec, cfg.cluster.placement_timeout_s, held), spec.bundles, owns_group=True)

    def _actor_options(self, slot: int) -> dict[str, Any]:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle_index = slot % len(self.bundles)
        cluster = self.cfg.cluster
        if self.owns_group:
            bundle = self.bundles[bundle_index]
            cpus, gpus = bundle.get("CPU", 0.0), bundle.get("GPU", 0.0)
            resources = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU")}
        else:
            # Colocated: the engine's CPU share was added to the trainer's bundle; the GPU stays the trainer's.
            cpus, gpus, resources = cluster.cpus_per_engine, 0.0, {}
        strategy = PlacementGroupSchedulingStrategy(self.placement_group, placement_group_bundle_index=bundle_index)
        return dict(num_cpus=cpus, num_gpus=gpus, resources=resources, max_restarts=0, max_concurrency=2,
                    scheduling_strategy=strategy)

    async def launch(self, slot: int, incarnation: int) -> EngineHandle:
        """Place engine `slot`'s actor in its bundle, start its server and return the fleet's handle."""
        import ray

        if self.state is not GangState.RESERVED:
            raise RuntimeError(f"the rollout gang is {self.state.value}; no engine can be launched")
        rollout = self.cfg.rollout
        env = {str(k): str(v) for k, v in rollout.engine_env.items()}
        actor = ray.remote(EngineServer).options(**self._actor_options(slot)).remote(
            rollout, str(self.cfg.model_path), self.log_dir, slot, incarnation, env, self.owns_group, self.api_key)
        self.actors[slot] = actor
        # Placement (a bundle whose node died waits for room) plus the server's own start-up.
        timeout = self.cfg.cluster.placement_timeout_s + rollout.startup_timeout_s
        try:
            location = await asyncio.wait_for(asyncio.wrap_future(actor.start.remote().future()), timeout)
        except TimeoutError as exc:
            self._kill(slot)
            raise EngineStartError(
                f"engine slot {slot} (incarnation {incarnation}) did not start within {timeout:.0f} s in bundle "
                f"{slot % len(self.bundles)} of the rollout gang {self.bundles[slot % len(self.bundles)]}: "
                "no node of the gang has room for it; the run continues on the other engines") from exc
        except BaseException:
            self._kill(slot)
            raise
        self._record(location)
        client = GangEngine(location, actor, rollout.request_timeout_s, self.api_key,
                            vocab_size=self.cfg.vocab_size)

        async def stop() -> None:
            await self.stop(slot, actor)

        async def diagnose(why: str) -> Path:
            title = dead_engine_title(location.engine_id, slot, incarnation, why, location.node_address)
            name, report = await asyncio.wrap_future(actor.stacks.remote(title).future())
            return write_atomic(Path(self.log_dir) / name, report)  # the run's logs, wherever the node's are

        return EngineHandle(client, stop=stop, pid=location.pid, location=location, diagnose=diagnose)

    def _record(self, location: EngineLocation) -> None:
        self.locations.append(location)
        logger.info("%s", location.describe())
        print(f"miles-lite: rollout gang: {location.describe()}", flush=True)
        record = {**dataclasses.asdict(location), "time": time.time()}
        append_line(Path(self.log_dir) / "engines.jsonl", json.dumps(record))

    async def stop(self, slot: int, actor: Any, grace_s: float = 10.0) -> None:
        """Stop the server through its actor, then end the actor (its bundle is free for a replacement)."""
        try:
            await asyncio.wait_for(asyncio.wrap_future(actor.stop.remote(grace_s).future()),
                                   grace_s + ACTOR_CALL_TIMEOUT_S)
        except Exception as exc:  # a dead actor took its server's process group down with it or cannot be asked
            logger.warning("engine slot %d: stopping through its actor failed (%r); killing the actor", slot, exc)
        if self.actors.get(slot) is actor:
            self._kill(slot)
        else:
            _kill_actor(actor)

    def _kill(self, slot: int) -> None:
        actor = self.actors.pop(slot, None)
        if actor is not None:
            _kill_actor(actor)

    def close(self) -> None:
        """Kill every engine actor left and release the gang if it is the rollout's own."""
        if self.state is GangState.CLOSED:
            return
        for slot in list(self.actors):
            self._kill(slot)
        if self.owns_group and self.placement_group is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.placement_group)
        self.placement_group = None
        self.state = GangState.CLOSED


def _kill_actor(actor: Any) -> None:
    import ray

    try:
        ray.kill(actor, no_restart=True)
    except Exception as exc:  # already gone
        logger.debug("ray.kill of an engine actor: %r", exc)



async def start_gang_fleet(gang: RolloutGang, *, health_checks: bool = True,
                           api_key: str | None = None) -> EngineFleet:
    """`rollout.engines` engines, one per bundle of `gang`, as one fleet whose replacements stay in the gang;
    they ask for `api_key`.

    If an engine fails to start, the ones already up are stopped before the error propagates.
    """
    cfg = gang.cfg
    gang.api_key = api_key
    fleet = EngineFleet(cfg.fault_tolerance, gang.launch, max_inflight_per_engine=cfg.rollout.max_inflight_per_engine)
    return await populate(fleet, fleet.launch(cfg.rollout.engines), health_checks)
