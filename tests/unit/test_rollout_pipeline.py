"""RolloutPipeline: background generation, pause for a weight push, resume on new weights, close."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from fake_rollout_engine import FakeEngine

from miles_lite.config.schema import FaultToleranceConfig, RolloutConfig
from miles_lite.data.gsm8k import MathProblem
from miles_lite.rollout.fleet import EngineFleet, EngineHandle
from miles_lite.rollout.manager import RolloutManager, is_mixed_version
from miles_lite.rollout.pipeline import PipelineState, RolloutPipeline
from miles_lite.rollout.sync_api import EventLoopThread
from miles_lite.run.rl_batch import drop_stale

GROUP, TOKENS = 3, 8


def _prompts(indices: range) -> list[tuple[int, list[int], MathProblem]]:
    return [(i, [1, 2, 3 + i], MathProblem(f"q{i}", f"#### {i}", float(i), ())) for i in indices]


@pytest.fixture
def setup() -> Iterator[tuple[EventLoopThread, list[FakeEngine], RolloutPipeline]]:
    loop = EventLoopThread().start()
    engines = [FakeEngine("a", version="1", delay_s=0.01), FakeEngine("b", version="1", delay_s=0.01)]
    ft = FaultToleranceConfig(health_interval_s=0.05, health_timeout_s=0.5, max_engine_restarts=0)
    cfg = RolloutConfig(group_size=GROUP, max_new_tokens=TOKENS, request_timeout_s=10.0, max_inflight_per_engine=2)

    async def build() -> RolloutManager:
        fleet = EngineFleet(ft, max_inflight_per_engine=cfg.max_inflight_per_engine)
        for e in engines:
            await fleet.add_engine(EngineHandle(e))
        return RolloutManager(fleet, cfg, ft, seed=5)

    manager = loop.run(build())
    try:
        yield loop, engines, RolloutPipeline(manager, loop, GROUP, timeout_s=30.0)
    finally:
        loop.stop()


def test_start_then_collect_returns_complete_groups_in_prompt_order(setup):
    _, _, pipe = setup
    pipe.start(_prompts(range(4)), tag="cursor-0")
    assert pipe.busy and pipe.tag == "cursor-0"
    result = pipe.collect()
    assert pipe.state is PipelineState.IDLE and not pipe.busy and pipe.tag is None
    assert [g.prompt_index for g in result.groups] == [0, 1, 2, 3] and result.tag == "cursor-0"
    assert all(len(g.samples) == GROUP and all(len(s.response_ids) == TOKENS for s in g.samples)
               for g in result.groups)
    assert result.stats.requests == 4 * GROUP and result.pauses == 0
    with pytest.raises(RuntimeError, match="call start"):
        pipe.collect()


def test_pause_mid_generation_resumes_partials_on_the_new_version(setup):
    loop, engines, pipe = setup
    fleet = pipe.manager.fleet
    pipe.start(_prompts(range(6)))
    # Pause once some completions are done and others are mid-decode: the push lands mid-generation.
    assert loop.run(fleet.wait_for(lambda: sum(r.requests_served for r in fleet.records) >= 2, 20.0))
    loop.run(asyncio.sleep(0.04))  # four tokens of decode time, so the in-flight requests hold partial output
    pipe.pause()
    assert pipe.state is PipelineState.PAUSED and pipe.manager.pending_groups > 0
    for engine in engines:  # what a push does: new weights, new version
        engine.version = "2"
    fleet.set_current_version("2")
    pipe.resume()
    result = pipe.collect()
    assert [g.prompt_index for g in result.groups] == list(range(6)) and result.pauses == 1
    samples = [s for g in result.groups for s in g.samples]
    assert all(len(s.response_ids) == len(s.rollout_logprobs) == TOKENS for s in samples)
    mixed = [s for s in samples if is_mixed_version(s)]
    assert mixed and all(s.weight_version == "1+2" for s in mixed)
    assert result.stats.resumed_partials >= len(mixed) and result.stats.aborted
    kept, stats = drop_stale(result.groups, current_version=2, max_staleness=1)
    assert len(kept) == 6 and stats["rollout/mixed_version_samples"] == len(mixed)
    assert stats["rollout/staleness_max"] == 1.0
    _, strict = drop_stale(result.groups, current_version=2, max_staleness=0)
    assert strict["rollout/stale_dropped"] >= 1


def test_pause_after_the_generation_finished_keeps_it_whole(setup):
    _, _, pipe = setup
    pipe.start(_prompts(range(2)))
    assert pipe.wait(20.0)
    pipe.pause()
    assert pipe.state is PipelineState.GENERATING  # nothing left to resume
    pipe.resume()
    result = pipe.collect()
    assert result.pauses == 0 and all(not is_mixed_version(s) for g in result.groups for s in g.samples)
    pipe.start(_prompts(range(2, 4)))  # a pause that held nothing leaves later batches free to run
    assert pipe.wait(20.0) and [g.prompt_index for g in pipe.collect().groups] == [2, 3]


def test_close_abandons_a_batch_in_flight_and_leaves_the_manager_clean(setup):
    _, _, pipe = setup
    pipe.start(_prompts(range(6)), tag={"cursor": 3})
    assert pipe.close() == {"cursor": 3}
    assert pipe.state is PipelineState.CLOSED and pipe.manager.pending_groups == 0
    assert pipe.close() is None
    with pytest.raises(RuntimeError, match="closed -> generating"):
        pipe.start(_prompts(range(1)))


def test_group_size_must_be_positive(setup):
    loop, _, pipe = setup
    with pytest.raises(ValueError, match="rollout.group_size"):
        RolloutPipeline(pipe.manager, loop, 0)


def _parity_scorer(groups) -> None:
    # Even prompts: every sample scores 0 (zero-signal); odd prompts: by the first token's parity.
    for g in groups:
        for s in g.samples:
            total = 0.0 if g.prompt_index % 2 == 0 else float(s.response_ids[0] % 2)
            s.rewards = {"parity": total, "total": total}


def test_dynamic_sampling_refills_to_the_started_size_across_a_pause():
    loop = EventLoopThread().start()
    engines = [FakeEngine("a", version="1", delay_s=0.01), FakeEngine("b", version="1", delay_s=0.01)]
    ft = FaultToleranceConfig(health_interval_s=0.05, health_timeout_s=0.5, max_engine_restarts=0)
    cfg = RolloutConfig(group_size=4, max_new_tokens=TOKENS, request_timeout_s=10.0, max_inflight_per_engine=2,
                        dynamic_sampling=True, max_sampling_rounds=6)
    drawn: list[int] = []
    fresh = iter(range(100, 10_000))

    def more(n: int):
        drawn.append(n)
        return _prompts([next(fresh) for _ in range(n)])

    async def build() -> RolloutManager:
        fleet = EngineFleet(ft, max_inflight_per_engine=cfg.max_inflight_per_engine)
        for e in engines:
            await fleet.add_engine(EngineHandle(e))
        return RolloutManager(fleet, cfg, ft, seed=5)

    try:
        manager = loop.run(build())
        pipe = RolloutPipeline(manager, loop, 4, timeout_s=30.0, scorer=_parity_scorer, more_prompts=more)
        pipe.start(_prompts(range(6)))  # prompts 0, 2, 4 can never have signal
        fleet = manager.fleet
        assert loop.run(fleet.wait_for(lambda: sum(r.requests_served for r in fleet.records) >= 2, 20.0))
        pipe.pause()
        for engine in engines:
            engine.version = "2"
        fleet.set_current_version("2")
        pipe.resume()
        result = pipe.collect()
        assert len(result.groups) == 6 and not any(g.is_zero_signal for g in result.groups)
        assert all(g.prompt_index % 2 == 1 for g in result.groups)
        assert result.stats.dropped_groups >= 3 and result.stats.refill_prompts == sum(drawn) >= 3
        assert 2 <= result.stats.sampling_rounds <= 6
    finally:
        loop.stop()


def test_several_batches_in_flight_generate_in_order_and_age_by_version(setup):
    loop, engines, pipe = setup
    fleet = pipe.manager.fleet
    for k in range(3):  # N = 2 batches ahead of the one being trained
        pipe.start(_prompts(range(4 * k, 4 * k + 4)), tag=f"cursor-{k}")
    assert pipe.pending == 3 and pipe.tag == "cursor-0"
    first = pipe.collect()  # batch 0, all on version 1
    assert [g.prompt_index for g in first.groups] == [0, 1, 2, 3] and first.tag == "cursor-0"
    assert pipe.pending == 2 and pipe.tag == "cursor-1"
    # The push after "step 0": batches 1 and 2 are generating or queued on version 1 until then.
    assert loop.run(fleet.wait_for(lambda: sum(r.requests_served for r in fleet.records) >= 4 * GROUP + 2, 20.0))
    pipe.pause()
    for engine in engines:
        engine.version = "2"
    fleet.set_current_version("2")
    pipe.resume()
    second, third = pipe.collect(), pipe.collect()
    assert pipe.state is PipelineState.IDLE and not pipe.busy
    assert [g.prompt_index for g in second.groups] == [4, 5, 6, 7] and second.tag == "cursor-1"
    assert [g.prompt_index for g in third.groups] == [8, 9, 10, 11] and third.tag == "cursor-2"
    versions = {s.weight_version for g in second.groups + third.groups for s in g.samples}
    assert versions <= {"1", "2", "1+2"} and "1" in {v.split("+")[0] for v in versions}
    # Trained at version 3 (two pushes later), the tokens written by version 1 are two versions old.
    kept, stats = drop_stale(third.groups + second.groups, current_version=3, max_staleness=1)
    old = [g for g in second.groups + third.groups if any(s.weight_version.startswith("1") for s in g.samples)]
    assert stats["rollout/stale_dropped"] == len(old) >= 1 and len(kept) == 8 - len(old)
    assert stats["rollout/staleness_max"] == 2.0 and stats["rollout/staleness_samples/2"] >= 1
