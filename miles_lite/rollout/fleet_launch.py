"""Wire `EngineLauncher` (engine server processes) into `EngineFleet` (lifecycle and replacement)."""

from __future__ import annotations

from miles_lite.config.schema import FaultToleranceConfig, RolloutConfig
from miles_lite.rollout.fleet import EngineFleet, EngineHandle, Launcher
from miles_lite.rollout.launcher import EngineLauncher


def fleet_launcher(launcher: EngineLauncher, stop_grace_s: float = 10.0) -> Launcher:
    """The fleet's `launcher(index, incarnation)` over `EngineLauncher.start/stop`.

    The handle's `pid` is the server process (what a fault-injection test SIGKILLs); `stop` ends
    its whole process group.
    """

    async def launch(index: int, incarnation: int) -> EngineHandle:
        launched = await launcher.start(index)

        async def stop() -> None:
            await launcher.stop(launched, stop_grace_s)

        return EngineHandle(launched.client, stop=stop, pid=launched.process.pid)

    return launch


async def start_fleet(
    rollout: RolloutConfig,
    ft: FaultToleranceConfig,
    model_path: str,
    log_dir: str,
    *,
    engines: int | None = None,
    health_checks: bool = True,
) -> EngineFleet:
    """Start `engines` (default `rollout.engines`) servers of `rollout.backend` as one fleet.

    The fleet owns the servers: `await fleet.close()` stops them all. With `health_checks`, the
    periodic health task runs from the start. If a server fails to start, the ones already up
    are stopped before the error propagates.
    """
    n = rollout.engines if engines is None else engines
    if n < 1:
        raise ValueError(f"rollout.engines must be >= 1, got {n}")
    launcher = EngineLauncher(rollout, model_path, log_dir, env={str(k): str(v) for k, v in rollout.engine_env.items()})
    fleet = EngineFleet(ft, fleet_launcher(launcher),
                        max_inflight_per_engine=rollout.max_inflight_per_engine)
    try:
        await fleet.launch(n)
    except BaseException:
        await fleet.close()
        raise
    if health_checks:
        fleet.start_health_checks()
    return fleet


async def attach_fleet(rollout: RolloutConfig, ft: FaultToleranceConfig, urls: list[str], *,
                       health_checks: bool = True) -> EngineFleet:
    """A fleet of engines started elsewhere (`rollout.engine_urls`, e.g. pods of the Kubernetes operator).

    The fleet does not own these servers: it health-checks them and stops routing to dead ones, but
    replacing them is the job of whoever started them (the operator recreates failed engine pods).
    """
    from miles_lite.rollout.http_client import HttpEngine

    fleet = EngineFleet(ft, None, max_inflight_per_engine=rollout.max_inflight_per_engine)
    try:
        for i, url in enumerate(urls):
            engine = HttpEngine(f"engine-{i}", url.rstrip("/"), request_timeout_s=rollout.request_timeout_s)
            await fleet.add_engine(EngineHandle(engine))
    except BaseException:
        await fleet.close()
        raise
    if health_checks:
        fleet.start_health_checks()
    return fleet
