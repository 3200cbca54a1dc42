"""A fleet following an engine list file (`rollout.engine_urls_file`, the operator's ConfigMap): engines that
appear are admitted (stale until a push when the fleet serves newer weights), engines that go are retired
without using up a restart, including one whose death was noticed before the list changed."""

from __future__ import annotations

import asyncio
from pathlib import Path

from miles_lite.config.schema import FaultToleranceConfig, RolloutConfig
from miles_lite.engines.engine_list import read_engine_list
from miles_lite.engines.fleet_launch import follow_engine_list
from miles_lite.rollout.engine_state import EngineState
from tests.unit.local_http import versioned_engine, wait_until


def test_read_engine_list(tmp_path: Path):
    f = tmp_path / "engines"
    f.write_text("http://a:1/\n\n# comment\nhttp://b:2\nhttp://a:1\n")
    assert read_engine_list(f) == ["http://a:1", "http://b:2"]
    assert read_engine_list(tmp_path / "missing") is None


def test_fleet_grows_and_shrinks_with_the_engine_list(tmp_path: Path):
    async def scenario() -> None:
        first, url0 = await versioned_engine("3")
        second, url1 = await versioned_engine("0")
        listing = tmp_path / "engines"
        listing.write_text(f"{url0}\n")
        ft = FaultToleranceConfig(health_interval_s=0.1, health_timeout_s=1.0, failure_threshold=1,
                                  max_engine_restarts=1)
        fleet, follower = await follow_engine_list([url0], RolloutConfig(startup_timeout_s=20.0), ft, str(listing))
        try:
            (rec0,) = fleet.records
            assert rec0.state is EngineState.HEALTHY and fleet.current_version == "3"
            # Scale up: the new engine serves older weights, so it waits for a push as stale.
            listing.write_text(f"{url0}\n{url1}\n")
            await wait_until(lambda: len(fleet.records) == 2 and fleet.records[1].state is EngineState.STALE)
            rec1 = fleet.records[1]
            assert rec1.engine_id == "engine-1" and fleet.healthy_engines() == [rec0.engine]
            assert fleet.mark_synced(rec1, "3")
            # Scale down: engine 1's pod goes first (its death is noticed), then the list drops it.
            await second.cleanup()
            await wait_until(lambda: rec1.state is EngineState.REPLACING)
            listing.write_text(f"{url0}\n")
            await wait_until(lambda: rec1.state is EngineState.RETIRED)
            await wait_until(lambda: fleet.restarts == 0)  # a removed engine is not a replacement
            assert fleet.healthy_engines() == [rec0.engine] and fleet.stats()["engines_total"] == 1.0
            await asyncio.sleep(0.5)  # several list passes: nothing comes back
            assert rec1.state is EngineState.RETIRED and len(fleet.records) == 2
        finally:
            await follower.stop()
            await fleet.close()
            await first.cleanup()

    asyncio.run(scenario())


def test_a_trainer_starts_with_the_engines_the_list_names_now(tmp_path: Path):
    """An engine the operator left out of the list (it cannot be scheduled) is not awaited at start, though the
    trainer's overrides name every engine; once listed, it is admitted."""

    async def scenario() -> None:
        first, url0 = await versioned_engine("0")
        unplaced = "http://127.0.0.1:9"  # nothing answers there: awaiting it would time out the start
        listing = tmp_path / "engines"
        listing.write_text(f"{url0}\n")
        ft = FaultToleranceConfig(health_interval_s=0.1, health_timeout_s=1.0, failure_threshold=1)
        fleet, follower = await follow_engine_list([url0, unplaced], RolloutConfig(startup_timeout_s=2.0), ft,
                                                   str(listing))
        second, url1 = await versioned_engine("0")
        try:
            assert [r.engine.url for r in fleet.records] == [url0]
            listing.write_text(f"{url0}\n{url1}\n")  # scheduled after all (at another address here)
            await wait_until(lambda: len(fleet.records) == 2)
            assert fleet.records[1].engine.url == url1
        finally:
            await follower.stop()
            await fleet.close()
            await first.cleanup()
            await second.cleanup()

    asyncio.run(scenario())
