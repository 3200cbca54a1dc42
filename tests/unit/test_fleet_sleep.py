"""The fleet's sleeping state: sleep/wake transitions, health checks, refused generation, push ordering; a push
leaves out an engine whose address answers from a new process."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from fake_rollout_engine import FakeEngine, TensorTransport

from miles_lite.config.schema import FaultToleranceConfig
from miles_lite.rollout.engine import EngineError
from miles_lite.rollout.fleet import TRANSITIONS, EngineFleet, EngineHandle, EngineState, FleetAsleep
from miles_lite.rollout.sync_api import EventLoopThread
from miles_lite.weight_sync.coordinator import WeightSyncCoordinator
from miles_lite.weight_sync.fleet_push import FleetPusher
from miles_lite.weight_sync.transport import EngineLoop
from miles_lite.weight_sync.verify import ProbeBatch, PushVerifier

S = EngineState
ALL = ["weights", "kv_cache", "cuda_graph"]


def _ft() -> FaultToleranceConfig:
    return FaultToleranceConfig(health_interval_s=0.05, health_timeout_s=0.2, failure_threshold=1,
                                max_engine_restarts=2, request_retries=3)


async def _fleet(*engines: FakeEngine, launcher=None) -> EngineFleet:
    fleet = EngineFleet(_ft(), launcher)
    for engine in engines:
        await fleet.add_engine(EngineHandle(engine))
    return fleet


def test_sleeping_is_in_the_transition_table():
    assert TRANSITIONS[S.HEALTHY] == {S.DEAD, S.SLEEPING, S.RETIRED}
    assert TRANSITIONS[S.SLEEPING] == {S.HEALTHY, S.DEAD, S.RETIRED}
    assert S.SLEEPING not in TRANSITIONS[S.STALE] and S.SLEEPING not in TRANSITIONS[S.STARTING]


def test_sleep_refuses_generation_and_wake_in_two_parts_serves_again():
    async def main() -> None:
        a, b = FakeEngine("a"), FakeEngine("b")
        fleet = await _fleet(a, b)
        slept = await fleet.sleep()
        assert [r.engine_id for r in slept] == ["a", "b"] and a.released == set(ALL)
        assert fleet.stats()["engines_sleeping"] == 2.0
        with pytest.raises(FleetAsleep, match=r"every rollout engine is asleep.*wake the fleet"):
            await fleet.acquire(timeout_s=5.0)
        # Weights first: still sleeping (the KV cache is released), still refused.
        assert [r.engine_id for r in await fleet.wake(["weights"])] == ["a", "b"]
        assert fleet.state_of("a") is S.SLEEPING and fleet.records[0].released == {"kv_cache", "cuda_graph"}
        with pytest.raises(FleetAsleep):
            await fleet.acquire(timeout_s=5.0)
        await fleet.wake()
        assert [fleet.state_of(x) for x in "ab"] == [S.HEALTHY, S.HEALTHY] and not a.released
        lease = await fleet.acquire(timeout_s=1.0)
        await fleet.release(lease, ok=True)
        assert a.log == ["release weights,kv_cache,cuda_graph", "resume weights", "resume kv_cache,cuda_graph"]
        moves = [(t.engine_id, t.old, t.new) for t in fleet.transitions if S.SLEEPING in (t.old, t.new)]
        assert moves == [("a", S.HEALTHY, S.SLEEPING), ("b", S.HEALTHY, S.SLEEPING),
                         ("a", S.SLEEPING, S.HEALTHY), ("b", S.SLEEPING, S.HEALTHY)]
        await fleet.close()

    asyncio.run(main())


def test_sleep_is_refused_with_requests_in_flight():
    async def main() -> None:
        fleet = await _fleet(FakeEngine("a"))
        lease = await fleet.acquire(timeout_s=1.0)
        with pytest.raises(ValueError, match=r"requests in flight \{'a': 1\}"):
            await fleet.sleep()
        assert fleet.state_of("a") is S.HEALTHY
        await fleet.release(lease, ok=True)
        await fleet.close()

    asyncio.run(main())


def test_health_checks_do_not_declare_a_sleeping_engine_dead():
    async def main() -> None:
        a = FakeEngine("a")
        fleet = await _fleet(a)
        await fleet.sleep()
        a.healthy = False  # what /health_generate of an engine without its memory answers
        for _ in range(3):
            await fleet.check_health()
        assert fleet.state_of("a") is S.SLEEPING and fleet.failed_health_checks == 0
        await fleet.close()

    asyncio.run(main())


def test_an_engine_that_cannot_resume_is_declared_dead_and_replaced():
    async def main() -> None:
        launched: list[FakeEngine] = []

        async def launcher(index: int, incarnation: int) -> EngineHandle:
            launched.append(FakeEngine(f"e{index}.{incarnation}"))
            return EngineHandle(launched[-1])

        a = FakeEngine("a")
        fleet = await _fleet(a, launcher=launcher)
        await fleet.sleep(["weights"])
        a.mode = "dead"
        assert await fleet.wake() == []
        assert await fleet.wait_for(lambda: fleet.records[0].state is S.HEALTHY, 5.0)
        assert [t.new for t in fleet.transitions][-4:] == [S.DEAD, S.REPLACING, S.STALE, S.HEALTHY]
        assert launched and fleet.records[0].engine is launched[0]
        await fleet.close()

    asyncio.run(main())


@pytest.fixture
def pushing() -> Iterator[tuple[EngineLoop, EngineFleet, FleetPusher, FakeEngine, FakeEngine]]:
    """Engines a and b in a fleet on a running event loop, and a pusher loading versions into them."""
    with EventLoopThread() as thread:
        engines = EngineLoop(thread.loop, timeout_s=10.0)
        a, b = FakeEngine("a"), FakeEngine("b")
        fleet = engines.run(_fleet(a, b))
        pusher = FleetPusher(WeightSyncCoordinator(TensorTransport(engines), engines), fleet, engines, 1, "reference")
        try:
            yield engines, fleet, pusher, a, b
        finally:
            engines.run(fleet.close())


def _assert_woken_once_and_pushed(report, fleet: EngineFleet, a: FakeEngine, b: FakeEngine) -> None:
    """Both engines released everything, resumed their weights once, loaded version "1", then resumed the rest."""
    assert report.push.engines == ("a", "b")
    for engine in (a, b):
        assert engine.log == ["release weights,kv_cache,cuda_graph", "resume weights", "update_weights",
                              "resume kv_cache,cuda_graph"]
    assert [r.state for r in fleet.records] == [S.HEALTHY, S.HEALTHY] and fleet.current_version == "1"


def test_a_push_to_sleeping_engines_resumes_weights_then_pushes_then_resumes_the_kv_cache(pushing):
    engines, fleet, pusher, a, b = pushing
    engines.run(fleet.sleep())
    report = pusher.push({}, "1")
    _assert_woken_once_and_pushed(report, fleet, a, b)
    assert pusher.wake_seconds > 0.0
    # An engine asleep with its weights released refuses a load: the order is what makes the push work.
    engines.run(fleet.sleep())
    with pytest.raises(EngineError, match="weights are released"):
        engines.run(a.update_weights_from_tensor([], None, "2"))


def test_a_push_to_engines_whose_weights_resumed_ahead_resumes_only_their_kv_cache(pushing):
    """The hand-off with `trainer.offload.when=needed` resumes the weights before the push (`Handoff`): the
    engines stay asleep (no request, no health probe reaches them) until the push has loaded and woken the rest."""
    engines, fleet, pusher, a, b = pushing
    engines.run(fleet.sleep())
    engines.run(fleet.wake(["weights"]))
    assert [r.state for r in fleet.records] == [S.SLEEPING, S.SLEEPING]
    report = pusher.push({}, "1")
    _assert_woken_once_and_pushed(report, fleet, a, b)


def test_a_push_leaves_out_an_engine_whose_address_answers_from_a_new_process(pushing):
    # A pod recreated under its name before a health check noticed: healthy by every probe, but serving
    # its initial weights and in no weight-update group. The push must not wait on it.
    _, fleet, pusher, a, b = pushing
    assert pusher.push({}, "1").push.engines == ("a", "b")
    b.version = "0"  # the new process at b's address
    report = pusher.push({}, "2")
    assert report.push.engines == ("a",)
    assert b.log.count("update_weights") == 1
    dead = [t for t in fleet.transitions if t.engine_id == "b" and t.new is S.DEAD]
    assert len(dead) == 1 and "restarted behind the fleet" in dead[0].reason and "served '1'" in dead[0].reason
    # An engine still serving what it was pushed is asked and pushed to as before.
    assert pusher.push({}, "3").push.engines == ("a",) and a.version == "3"


def test_a_push_asks_only_engines_started_elsewhere_whether_they_were_replaced():
    # A local child's address answers from no other process: its version is asked once, by the push's own
    # check after the load; an attached engine (a pod, a URL) is asked before the push too.
    with EventLoopThread() as thread:
        engines = EngineLoop(thread.loop, timeout_s=10.0)
        child, attached = FakeEngine("child"), FakeEngine("attached")
        asked: list[str] = []
        for engine in (child, attached):
            def counted(engine: FakeEngine = engine, answer=engine.weight_version):
                asked.append(engine.engine_id)
                return answer()
            engine.weight_version = counted  # type: ignore[method-assign]

        async def fleet_of_both() -> EngineFleet:
            fleet = EngineFleet(_ft(), None)
            await fleet.add_engine(EngineHandle(child, pid=4321))
            await fleet.add_engine(EngineHandle(attached))
            return fleet

        fleet = engines.run(fleet_of_both())
        pusher = FleetPusher(WeightSyncCoordinator(TensorTransport(engines), engines), fleet, engines, 1, "reference")
        try:
            assert [r.handle.local_child for r in fleet.records] == [True, False]
            pusher.push({}, "1")
            asked.clear()
            assert pusher.push({}, "2").push.engines == ("child", "attached")
            assert sorted(asked) == ["attached", "attached", "child"], asked
        finally:
            engines.run(fleet.close())


def test_probe_scores_taken_ahead_serve_the_push_to_sleeping_engines():
    # A hand-off push takes the trainer's probe scores before its offload (run/handoff.py): the verification
    # of that push uses them instead of asking the trainer again.
    with EventLoopThread() as thread:
        engines = EngineLoop(thread.loop, timeout_s=10.0)
        a = FakeEngine("a")
        calls: list[str] = []

        def trainer_scores(probe: ProbeBatch) -> list[list[float]]:
            calls.append("trainer")
            rows = zip(probe.sequences, probe.prompt_lens, strict=True)
            return [[-(t % 5) / 10 for t in seq[plen:]] for seq, plen in rows]

        probe = ProbeBatch(sequences=((1, 2, 3), (4, 5, 6)), prompt_lens=(1, 1))
        verifier = PushVerifier(engines, probe, trainer_scores, max_probe_logp_diff=0.1)
        fleet = engines.run(_fleet(a))
        pusher = FleetPusher(WeightSyncCoordinator(TensorTransport(engines), engines, verifier), fleet, engines, 1,
                             "reference")
        try:
            engines.run(fleet.sleep())
            assert pusher.sync.score_trainer_probe("1") > 0.0
            report = pusher.push({}, "1")
            assert calls == ["trainer"]  # taken ahead, not again by the verification
            assert report.verify is not None and report.verify.logp_diff_mean == 0.0
            assert a.log[-3:] == ["resume weights", "update_weights", "resume kv_cache,cuda_graph"]
            # Without scores taken ahead the verification asks the trainer itself.
            pusher.push({}, "2")
            assert calls == ["trainer", "trainer"]
        finally:
            engines.run(fleet.close())
