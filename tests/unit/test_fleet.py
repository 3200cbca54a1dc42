"""EngineFleet: the lifecycle table, health checks, replacement, stale admission, request accounting."""

from __future__ import annotations

import asyncio

import pytest
from fake_rollout_engine import FakeEngine

from miles_lite.config.schema import FaultToleranceConfig
from miles_lite.rollout.engine import RolloutEngine
from miles_lite.rollout.fleet import (
    TRANSITIONS,
    EngineFleet,
    EngineHandle,
    EngineState,
    FleetExhausted,
    IllegalTransition,
)

S = EngineState


def _ft(**kw: float) -> FaultToleranceConfig:
    base = dict(health_interval_s=0.05, health_timeout_s=0.2, failure_threshold=2, max_engine_restarts=2,
                request_retries=3)
    base.update(kw)
    return FaultToleranceConfig(**base)  # type: ignore[arg-type]


def _pushed(fleet: EngineFleet, engine: object, version: str) -> bool:
    """What a weight push does: the engine loads `version`, then the fleet records it (`mark_synced`)."""
    rec = next(r for r in fleet.records if engine in (r, r.engine, r.engine_id))
    rec.engine.version = version  # type: ignore[attr-defined]
    return fleet.mark_synced(rec, version)


class Launcher:
    """Starts FakeEngines named slot.incarnation and remembers which handles were stopped."""

    def __init__(self, mode: str = "ok", version: str = "0") -> None:
        self.mode = mode
        self.version = version
        self.launched: list[FakeEngine] = []
        self.stopped: list[str] = []

    async def __call__(self, index: int, incarnation: int) -> EngineHandle:
        if self.mode == "raise":
            raise OSError("no free port")
        engine = FakeEngine(f"e{index}.{incarnation}", version=self.version, mode=self.mode)
        self.launched.append(engine)
        return EngineHandle(engine, stop=lambda: self.stopped.append(engine.engine_id))


def test_transition_table_is_the_documented_lifecycle():
    assert TRANSITIONS[S.STARTING] == {S.HEALTHY, S.STALE, S.DEAD, S.RETIRED}
    assert TRANSITIONS[S.HEALTHY] == {S.DEAD, S.SLEEPING, S.RETIRED}
    assert TRANSITIONS[S.SLEEPING] == {S.HEALTHY, S.DEAD, S.RETIRED}
    assert TRANSITIONS[S.DEAD] == {S.REPLACING, S.RETIRED}
    assert TRANSITIONS[S.REPLACING] == {S.STALE, S.DEAD, S.RETIRED}
    assert TRANSITIONS[S.STALE] == {S.HEALTHY, S.DEAD, S.RETIRED}
    assert TRANSITIONS[S.RETIRED] == set()  # final
    assert set(TRANSITIONS) == set(S)


def test_fake_engine_satisfies_the_protocol():
    assert isinstance(FakeEngine("x"), RolloutEngine)


def test_illegal_transition_raises_with_allowed_targets():
    async def main() -> None:
        fleet = EngineFleet(_ft())
        rec = await fleet.add_engine(EngineHandle(FakeEngine("a")))
        assert rec.state is S.HEALTHY and rec.version == "0"
        allowed = r"\['dead', 'retired', 'sleeping'\]"
        with pytest.raises(IllegalTransition, match=r"healthy -> stale is not allowed.*" + allowed):
            fleet._set_state(rec, S.STALE, "test")
        await fleet.close()

    asyncio.run(main())


def test_failed_health_checks_kill_replace_and_admit_after_sync():
    async def main() -> None:
        launcher = Launcher()
        fleet = EngineFleet(_ft(), launcher, current_version="0")
        console: list[str] = []
        fleet.on_event = console.append
        a, b = await fleet.launch(2)
        assert [r.state for r in fleet.records] == [S.HEALTHY, S.HEALTHY]
        assert console == []  # first starts are routine
        fleet.set_current_version("3")  # a training step happened; both engines then got version 3
        assert _pushed(fleet, a.engine, "3") and _pushed(fleet, "e1.0", "3")
        assert fleet.engines_needing_weights() == []

        a.engine.healthy = False  # type: ignore[attr-defined]
        await fleet.check_health()
        assert a.state is S.HEALTHY, "one failed check is below failure_threshold=2"
        await fleet.check_health()
        assert a.state is S.DEAD
        assert await fleet.wait_for(lambda: a.state is S.STALE, 5.0)
        assert launcher.stopped == ["e0.0"], "the dead engine's server is stopped before its replacement"
        assert a.engine_id == "e0.1" and a.incarnation == 1
        assert fleet.healthy_engines() == [b.engine]
        assert fleet.engines_needing_weights() == [a.engine]

        assert not _pushed(fleet, a, "2"), "an older version must not admit a stale engine"
        assert a.state is S.STALE
        assert _pushed(fleet, a, "3")
        assert a.state is S.HEALTHY and len(fleet.healthy_engines()) == 2
        path = [(t.old, t.new) for t in fleet.transitions if t.slot == 0]
        assert path == [(S.STARTING, S.HEALTHY), (S.HEALTHY, S.DEAD), (S.DEAD, S.REPLACING),
                        (S.REPLACING, S.STALE), (S.STALE, S.HEALTHY)]
        # What the console shows of it, one line per event.
        assert len(console) == 4 and all(line.startswith("fleet: engine slot 0 (") for line in console)
        assert "is dead" in console[0] and "starting a replacement (restart 1/" in console[1]
        assert "replacement up" in console[2] and console[3].endswith("replacement admitted after push 3")
        stats = fleet.stats()
        assert stats["restarts"] == 1 and stats["engines_healthy"] == 2 and stats["failed_health_checks"] == 2
        await fleet.close()
        assert sorted(launcher.stopped) == ["e0.0", "e0.1", "e1.0"]

    asyncio.run(main())


def test_background_health_task_detects_a_hung_engine():
    async def main() -> None:
        fleet = EngineFleet(_ft(), Launcher())
        (rec,) = await fleet.launch(1)
        _pushed(fleet, rec, "1")  # pushed once: a replacement (at "0") waits for a push
        fleet.start_health_checks()
        rec.engine.mode = "hang"  # type: ignore[attr-defined]
        assert await fleet.wait_for(lambda: rec.state is S.STALE, 5.0)
        assert fleet.stats()["failed_health_checks"] >= 2
        await fleet.close()
        assert fleet._health_task is None

    asyncio.run(main())


def test_a_replacement_before_any_push_is_admitted_at_once():
    """No push yet: the replacement starts from the checkpoint the fleet serves, so it needs none."""
    async def main() -> None:
        fleet = EngineFleet(_ft(failure_threshold=1), Launcher())
        console: list[str] = []
        fleet.on_event = console.append
        (rec,) = await fleet.launch(1)
        rec.engine.healthy = False  # type: ignore[attr-defined]
        await fleet.check_health()
        assert await fleet.wait_for(lambda: rec.incarnation == 1 and rec.state is S.HEALTHY, 5.0)
        assert [t.new for t in fleet.transitions if t.slot == 0][-2:] == [S.STALE, S.HEALTHY]
        assert console[-1].endswith("replacement admitted at once: it already serves the current weight "
                                    "version '0'")
        await fleet.close()

    asyncio.run(main())


def test_a_request_waiting_with_only_a_stale_replacement_calls_on_starved():
    async def main() -> None:
        fleet = EngineFleet(_ft(failure_threshold=1), Launcher())
        (rec,) = await fleet.launch(1)
        _pushed(fleet, rec, "1")
        starved: list[bool] = []
        fleet.on_starved = lambda: starved.append(fleet.starved())
        rec.engine.healthy = False  # type: ignore[attr-defined]
        await fleet.check_health()
        waiter = asyncio.ensure_future(fleet.acquire(timeout_s=5.0))
        assert await fleet.wait_for(lambda: rec.state is S.STALE, 5.0)
        assert await fleet.wait_for(lambda: bool(starved), 5.0)
        assert not waiter.done() and all(starved)
        assert _pushed(fleet, rec, "1")  # the push the callback asks for
        lease = await asyncio.wait_for(waiter, 5.0)
        assert lease.engine_id == "e0.1"
        await fleet.release(lease, ok=True)
        await fleet.close()

    asyncio.run(main())


def test_a_late_health_answer_from_an_engine_completing_requests_is_no_failure():
    """A saturated engine answers its check after the timeout, but requests complete: it is alive."""
    async def main() -> None:
        fleet = EngineFleet(_ft(failure_threshold=1), Launcher())
        (rec,) = await fleet.launch(1)
        lease = await fleet.acquire()
        rec.engine.mode = "hang"  # type: ignore[attr-defined]
        check = asyncio.ensure_future(fleet.check_health())
        await asyncio.sleep(0.05)  # the probe is waiting on the engine
        await fleet.release(lease, ok=True)  # a request completes meanwhile
        await check
        assert rec.state is S.HEALTHY and rec.health_failures == 0
        probes = rec.engine.health_probes  # type: ignore[attr-defined]
        await fleet.check_health()  # it served since the last round began: alive, not probed
        assert rec.state is S.HEALTHY and rec.engine.health_probes == probes  # type: ignore[attr-defined]
        await fleet.check_health()  # nothing served since: the probe counts
        assert rec.state is S.DEAD
        await fleet.close()

    asyncio.run(main())


def test_an_engine_that_served_since_the_last_round_is_not_probed():
    """SGLang's `/health_generate` takes a second at least, and a colocated engine's sleep waits for the probes
    in flight: a round right after generation leaves the engines that just served alone."""
    async def main() -> None:
        fleet = EngineFleet(_ft(failure_threshold=1), Launcher())
        a, b = await fleet.launch(2)
        lease = await fleet.acquire()
        served = a if lease.engine_id == a.engine_id else b
        idle = b if served is a else a
        probes = {r.engine_id: r.engine.health_probes for r in (a, b)}  # type: ignore[attr-defined]
        await fleet.release(lease, ok=True)
        await fleet.check_health()
        assert served.engine.health_probes == probes[served.engine_id]  # type: ignore[attr-defined]
        assert idle.engine.health_probes == probes[idle.engine_id] + 1  # type: ignore[attr-defined]
        await fleet.sleep()  # no probe in flight for the release to wait for
        assert served.state is S.SLEEPING and idle.state is S.SLEEPING
        await fleet.close()

    asyncio.run(main())


def test_an_engine_held_by_a_weight_update_is_not_health_checked():
    """A push pauses the engine and its health answers wait (a large load outlasts several checks):
    it stays healthy through the update; after it, checks resume with a clean count."""
    async def main() -> None:
        fleet = EngineFleet(_ft(), Launcher())
        (rec,) = await fleet.launch(1)
        fleet.start_health_checks()
        fleet.begin_weight_update([rec])
        rec.engine.mode = "hang"  # type: ignore[attr-defined]
        await asyncio.sleep(1.0)  # five health periods, each check would time out after 0.2 s
        assert rec.state is S.HEALTHY and fleet.stats()["failed_health_checks"] == 0
        rec.engine.mode = "ok"  # type: ignore[attr-defined]
        fleet.end_weight_update([rec], answered=True)
        await asyncio.sleep(0.3)
        assert rec.state is S.HEALTHY and rec.health_failures == 0

        rec.engine.mode = "hang"  # type: ignore[attr-defined]
        assert await fleet.wait_for(lambda: rec.state is S.DEAD or rec.incarnation > 0, 5.0), \
            "outside an update a hung engine is still caught"
        await fleet.close()

    asyncio.run(main())


def test_a_check_that_overlapped_the_start_of_an_update_is_not_counted():
    async def main() -> None:
        fleet = EngineFleet(_ft(failure_threshold=1), Launcher())
        (rec,) = await fleet.launch(1)
        rec.engine.mode = "hang"  # type: ignore[attr-defined]
        check = asyncio.ensure_future(fleet.check_health())
        await asyncio.sleep(0.05)  # the probe is waiting on the engine
        fleet.begin_weight_update([rec])
        await check
        assert rec.state is S.HEALTHY and rec.health_failures == 0
        await fleet.close()

    asyncio.run(main())


def test_confirm_dead_declares_only_the_engines_that_fail_a_check_now():
    async def main() -> None:
        launcher = Launcher()
        fleet = EngineFleet(_ft(failure_threshold=5), launcher)
        a, b = await fleet.launch(2)
        _pushed(fleet, a, "1")
        _pushed(fleet, b, "1")
        a.engine.mode = "dead"  # type: ignore[attr-defined]
        dead = await fleet.confirm_dead([a, b])
        assert dead == [a] and b.state is S.HEALTHY
        assert [t.new for t in fleet.transitions if t.slot == 0][-1] is S.DEAD, "one check suffices, not five"
        assert await fleet.wait_for(lambda: a.state is S.STALE, 5.0), "the dead engine is replaced"
        assert await fleet.confirm_dead([b]) == []
        await fleet.close()

    asyncio.run(main())


def test_restart_budget_exhausted_leaves_engine_dead_and_acquire_fails_fast():
    async def main() -> None:
        launcher = Launcher(mode="raise")
        fleet = EngineFleet(_ft(max_engine_restarts=2), launcher)
        rec = await fleet.add_engine(EngineHandle(FakeEngine("a"), stop=lambda: launcher.stopped.append("a")))
        lease = await fleet.acquire()
        await fleet.release(lease, ok=False, error="ConnectionResetError")
        assert rec.state is S.HEALTHY
        lease = await fleet.acquire()
        await fleet.release(lease, ok=False, error="ConnectionResetError")
        assert rec.state is S.DEAD
        assert await fleet.wait_for(lambda: not fleet.can_recover(), 5.0)
        assert fleet.restarts == 2 and rec.state is S.DEAD
        assert "launch failed" in rec.last_error
        with pytest.raises(FleetExhausted, match="none can recover"):
            await fleet.acquire(timeout_s=5.0)
        assert fleet.stats()["failed_requests"] == 2
        await fleet.close()

    asyncio.run(main())


def test_replacement_that_fails_its_first_check_is_retried():
    async def main() -> None:
        launcher = Launcher(mode="dead")
        fleet = EngineFleet(_ft(max_engine_restarts=3), launcher, auto_replace=False)
        rec = await fleet.add_engine(EngineHandle(FakeEngine("a", mode="dead")))
        assert rec.state is S.DEAD, "an engine failing its first health check never serves"
        await fleet.replace_dead()
        assert rec.state is S.DEAD and fleet.restarts == 3 and len(launcher.launched) == 3
        assert not fleet.can_recover()
        await fleet.close()

    asyncio.run(main())


def test_acquire_picks_least_outstanding_and_respects_capacity_and_exclusion():
    async def main() -> None:
        fleet = EngineFleet(_ft(), max_inflight_per_engine=2)
        a = await fleet.add_engine(EngineHandle(FakeEngine("a")))
        b = await fleet.add_engine(EngineHandle(FakeEngine("b")))
        l1 = await fleet.acquire()
        l2 = await fleet.acquire()
        assert {l1.engine_id, l2.engine_id} == {"a", "b"}
        l3 = await fleet.acquire(exclude=frozenset({"a"}))
        assert l3.engine_id == "b" and b.inflight == 2
        # b is full: wait for it rather than go back to the excluded engine...
        with pytest.raises(FleetExhausted):
            await fleet.acquire(exclude=frozenset({"a"}), timeout_s=0.05)
        # ...which is used only when no other engine is healthy.
        l4 = await fleet.acquire(exclude=frozenset({"a", "b"}))
        assert l4.engine_id == "a" and a.inflight == 2
        waiter = asyncio.ensure_future(fleet.acquire(timeout_s=5.0))
        await asyncio.sleep(0.05)  # give the waiter a chance to run; it must block on capacity
        assert not waiter.done()
        await fleet.release(l3, ok=True)
        lease = await asyncio.wait_for(waiter, 5.0)
        assert lease.engine_id == "b"
        with pytest.raises(FleetExhausted, match="within 0.1s"):
            await fleet.acquire(timeout_s=0.1)
        for held in (l1, l2, l4, lease):
            await fleet.release(held, ok=True)
        assert fleet.stats()["inflight_requests"] == 0
        await fleet.close()

    asyncio.run(main())


def test_release_from_a_replaced_incarnation_does_not_corrupt_accounting():
    async def main() -> None:
        fleet = EngineFleet(_ft(failure_threshold=1), Launcher())
        (rec,) = await fleet.launch(1)
        _pushed(fleet, rec, "1")
        old = await fleet.acquire()
        rec.engine.healthy = False  # type: ignore[attr-defined]
        await fleet.check_health()
        assert await fleet.wait_for(lambda: rec.state is S.STALE, 5.0)
        await fleet.release(old, ok=False, error="ConnectionResetError")
        assert rec.inflight == 0 and rec.state is S.STALE
        await fleet.close()

    asyncio.run(main())


def test_bad_config_is_rejected_with_the_field_name():
    with pytest.raises(ValueError, match="failure_threshold"):
        EngineFleet(_ft(failure_threshold=0))
    with pytest.raises(ValueError, match="max_inflight_per_engine"):
        EngineFleet(_ft(), max_inflight_per_engine=0)
    with pytest.raises(ValueError, match="needs a launcher"):
        asyncio.run(EngineFleet(_ft()).launch(1))


class _SizedEngine(FakeEngine):
    """A FakeEngine that reports SGLang's `/get_server_info` shape with a running-batch capacity."""

    def __init__(self, engine_id: str, per_dp: list[int]) -> None:
        super().__init__(engine_id)
        self.per_dp = per_dp

    async def server_info(self) -> dict:
        return {"max_running_requests": None,
                "internal_states": [{"effective_max_running_requests_per_dp": n} for n in self.per_dp]}


def test_engine_capacity_reads_sglang_and_reference_server_info():
    from miles_lite.rollout.engine_state import engine_capacity

    assert engine_capacity({"internal_states": [{"effective_max_running_requests_per_dp": 48}] * 2}) == 96
    assert engine_capacity({"max_running_requests": 7, "internal_states": [{"paused": False}]}) == 7
    assert engine_capacity({"max_running_requests": None, "internal_states": []}) is None
    # Decode batches above SGLang's CUDA-graph size run eagerly: the capacity stops there (per scheduler).
    graphs = {"cuda_graph_max_bs": 256, "disable_cuda_graph": False,
              "internal_states": [{"effective_max_running_requests_per_dp": 4096}] * 2}
    assert engine_capacity(graphs) == 512
    assert engine_capacity({**graphs, "disable_cuda_graph": True}) == 8192
    # SGLang after 0.5.10 reports the graphs as the decode phase of its resolved `cuda_graph_config`.
    resolved = {"cuda_graph_config": {"decode": {"backend": "full", "max_bs": 256, "bs": [1, 2, 4]},
                                      "prefill": {"backend": "disabled", "max_bs": None}},
                "cuda_graph_max_bs_decode": None, "disable_cuda_graph": False,
                "internal_states": [{"effective_max_running_requests_per_dp": 4096}]}
    assert engine_capacity(resolved) == 256
    resolved["cuda_graph_config"]["decode"]["max_bs"] = 512
    assert engine_capacity(resolved) == 512
    resolved["cuda_graph_config"]["decode"]["backend"] = "disabled"
    assert engine_capacity(resolved) == 4096


def test_default_inflight_limit_is_each_engines_own_capacity():
    async def main() -> None:
        fleet = EngineFleet(_ft())  # no configured limit
        small = await fleet.add_engine(EngineHandle(_SizedEngine("small", [1])))
        big = await fleet.add_engine(EngineHandle(_SizedEngine("big", [2, 1])))
        plain = EngineFleet(_ft(), max_inflight_per_engine=5)
        fixed = await plain.add_engine(EngineHandle(_SizedEngine("fixed", [1])))
        assert (small.capacity, big.capacity, fixed.capacity) == (1, 3, None)
        leases = [await fleet.acquire() for _ in range(4)]
        assert sorted(lease.engine_id for lease in leases) == ["big", "big", "big", "small"]
        with pytest.raises(FleetExhausted):
            await fleet.acquire(timeout_s=0.05)
        for lease in leases:
            await fleet.release(lease, ok=True)
        await fleet.close()
        await plain.close()

    asyncio.run(main())
