"""A fleet attached to engines started elsewhere re-admits a dead engine once its URL answers again (the
operator recreated its pod under the same name): as stale, counted against max_engine_restarts."""

from __future__ import annotations

import asyncio

from aiohttp import web

from miles_lite.config.schema import FaultToleranceConfig, RolloutConfig
from miles_lite.engines.fleet_launch import attach_fleet
from miles_lite.rollout.engine_state import EngineState
from tests.unit.local_http import versioned_engine, wait_until


async def _serve(port: int, version: str) -> web.AppRunner:
    runner, _ = await versioned_engine(version, port)
    return runner


ROLLOUT = RolloutConfig(startup_timeout_s=20.0)


def _ft(failure_threshold: int, max_engine_restarts: int = 1) -> FaultToleranceConfig:
    """Health checks every 0.1 s (when running) with a 1 s timeout."""
    return FaultToleranceConfig(health_interval_s=0.1, health_timeout_s=1.0, failure_threshold=failure_threshold,
                                max_engine_restarts=max_engine_restarts)


def test_dead_attached_engine_is_readmitted_stale_when_its_url_answers_again():
    async def scenario() -> None:
        first = await _serve(0, "3")
        port = first.addresses[0][1]
        rollout, ft = ROLLOUT, _ft(1)
        fleet = await attach_fleet(rollout, ft, [f"http://127.0.0.1:{port}"])
        try:
            (rec,) = fleet.records
            assert rec.state is EngineState.HEALTHY and fleet.current_version == "3"
            await first.cleanup()  # the engine pod dies
            await wait_until(lambda: rec.state is EngineState.REPLACING)
            assert fleet.restarts == 1
            second = await _serve(port, "0")  # its replacement pod answers at the same address
            try:
                await wait_until(lambda: rec.state is EngineState.STALE)
                assert rec.version == "0" and fleet.healthy_engines() == []
                # The next push (version 3) makes it serve again.
                assert fleet.mark_synced(rec, "3")
            finally:
                await second.cleanup()
        finally:
            await fleet.close()

    asyncio.run(scenario())


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_attach_awaits_engines_that_start_after_the_trainer():
    # Pods start in any order: an engine still loading at attach time is awaited, not declared dead.
    async def scenario() -> None:
        early = await _serve(0, "0")
        late_port = _free_port()
        rollout, ft = ROLLOUT, _ft(1, 0)
        attach = asyncio.ensure_future(attach_fleet(
            rollout, ft, [f"http://127.0.0.1:{early.addresses[0][1]}", f"http://127.0.0.1:{late_port}"],
            poll_s=0.05))
        await asyncio.sleep(0.5)
        assert not attach.done()
        late = await _serve(late_port, "0")
        fleet = await attach
        try:
            assert [r.state for r in fleet.records] == [EngineState.HEALTHY] * 2
            assert fleet.restarts == 0 and [r.engine_id for r in fleet.records] == ["engine-0", "engine-1"]
        finally:
            await fleet.close()
            await early.cleanup()
            await late.cleanup()

    asyncio.run(scenario())


def test_attach_names_an_engine_that_never_answers():
    async def scenario() -> None:
        rollout = RolloutConfig(startup_timeout_s=0.3)
        url = f"http://127.0.0.1:{_free_port()}"
        try:
            await attach_fleet(rollout, FaultToleranceConfig(), [url], poll_s=0.05)
        except TimeoutError as exc:
            assert url in str(exc) and "rollout.startup_timeout_s=0.3" in str(exc) and "at start" in str(exc)
        else:
            raise AssertionError("attach_fleet returned without the engine answering")

    asyncio.run(scenario())


async def _restart_at_same_address(runner: web.AppRunner, port: int, version: str) -> web.AppRunner:
    """The engine's pod is recreated under its name faster than a health check could fail."""
    await runner.cleanup()
    return await _serve(port, version)


def test_engine_restarted_between_health_checks_is_declared_dead_and_readmitted_stale():
    # A recreated pod answers health checks at once but serves its initial weights: the fleet must not
    # keep routing rollouts to it as if it held the version it recorded.
    async def scenario() -> None:
        first = await _serve(0, "0")
        port = first.addresses[0][1]
        rollout, ft = ROLLOUT, _ft(3)
        fleet = await attach_fleet(rollout, ft, [f"http://127.0.0.1:{port}"], health_checks=False)
        second = None
        try:
            (rec,) = fleet.records
            fleet.set_current_version("4")
            assert fleet.mark_synced(rec, "4")  # what the last push left it serving
            second = await _restart_at_same_address(first, port, "0")
            await fleet.check_health()  # one round: the probe passes, the version gives it away
            dead = [t for t in fleet.transitions if t.new is EngineState.DEAD]
            assert len(dead) == 1 and "reports weight version '0'" in dead[0].reason, dead
            assert "served '4'" in dead[0].reason
            await wait_until(lambda: rec.state is EngineState.STALE)
            assert rec.version == "0" and rec.incarnation == 1 and fleet.restarts == 1
        finally:
            await (second or first).cleanup()
            await fleet.close()

    asyncio.run(scenario())


def test_failed_push_finds_the_engine_restarted_behind_it_and_spares_the_one_that_took_the_version():
    async def scenario() -> None:
        a, b = await _serve(0, "2"), await _serve(0, "2")
        ports = [a.addresses[0][1], b.addresses[0][1]]
        fleet = await attach_fleet(ROLLOUT, _ft(3),
                                   [f"http://127.0.0.1:{p}" for p in ports], health_checks=False)
        try:
            # Pushing version 3 failed: engine-0 had loaded it, engine-1's pod was recreated meanwhile.
            fleet.set_current_version("3")
            fleet.begin_weight_update(fleet.records)
            await a.cleanup()
            a = await _serve(ports[0], "3")
            b = await _restart_at_same_address(b, ports[1], "0")
            dead = await fleet.confirm_dead(fleet.records)
            assert [r.engine_id for r in dead] == ["engine-1"], [r.engine_id for r in dead]
            assert fleet.records[0].state is EngineState.HEALTHY
            fleet.end_weight_update(fleet.records, answered=False)
        finally:
            await fleet.close()
            await a.cleanup()
            await b.cleanup()

    asyncio.run(scenario())
