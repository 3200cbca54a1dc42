"""RolloutManager scheduling: fan-out, retries, hangs, abort/resume, dynamic sampling, sync facade, table."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence

import pytest
from fake_rollout_engine import FakeEngine

from miles_lite.config.schema import FaultToleranceConfig, RolloutConfig
from miles_lite.data.gsm8k import MathProblem
from miles_lite.observability.metrics import MetricsRegistry
from miles_lite.observability.rollout_table import rows_from_groups
from miles_lite.rollout.fleet import EngineFleet, EngineHandle, EngineState, FleetExhausted
from miles_lite.rollout.manager import RolloutError, RolloutManager, is_mixed_version
from miles_lite.rollout.prompt_spec import PromptSpec, as_prompt_spec
from miles_lite.rollout.sync_api import EventLoopThread, SyncRolloutManager
from miles_lite.run.rl_batch import rollout_stats
from miles_lite.types import Group, Sample, SamplingParams


def _cfgs(**rollout: object) -> tuple[RolloutConfig, FaultToleranceConfig]:
    base: dict[str, object] = dict(group_size=4, max_new_tokens=6, request_timeout_s=5.0)
    base.update(rollout)
    ft = FaultToleranceConfig(health_interval_s=0.05, health_timeout_s=0.2, failure_threshold=2,
                              max_engine_restarts=0, request_retries=3)
    return RolloutConfig(**base), ft  # type: ignore[arg-type]


def _prompts(indices: Sequence[int]) -> list[tuple[int, list[int], MathProblem]]:
    return [(i, [1, 2, 3 + i], MathProblem(f"q{i}", f"#### {i}", float(i), (1.0,))) for i in indices]


async def _setup(*engines: FakeEngine, **rollout: object) -> tuple[EngineFleet, RolloutManager]:
    rcfg, ft = _cfgs(**rollout)
    fleet = EngineFleet(ft)
    for engine in engines:
        await fleet.add_engine(EngineHandle(engine))
    return fleet, RolloutManager(fleet, rcfg, ft, decode=lambda ids: " ".join(map(str, ids)), seed=7)


def _assert_complete(groups: list[Group], indices: Sequence[int], group_size: int, tokens: int) -> None:
    assert [g.prompt_index for g in groups] == list(indices)
    for g in groups:
        assert len(g.samples) == group_size
        for s in g.samples:
            assert len(s.response_ids) == len(s.rollout_logprobs) == tokens
            assert s.prompt_ids == [1, 2, 3 + g.prompt_index]
            assert s.response_text == " ".join(map(str, s.response_ids))
    # Distinct per-sample seeds: no two samples of a group are the same completion.
    for g in groups:
        assert len({tuple(s.response_ids) for s in g.samples}) == group_size


def test_groups_are_complete_balanced_and_carry_metadata():
    async def main() -> None:
        a, b = FakeEngine("a", delay_s=0.001), FakeEngine("b", delay_s=0.001)
        fleet, mgr = await _setup(a, b)
        groups = await mgr.generate_groups(_prompts(range(5)))
        _assert_complete(groups, range(5), 4, 6)
        assert groups[3].question == "q3" and groups[3].answer == 3.0 and groups[3].steps == (1.0,)
        st = mgr.last_stats
        assert st.requests == 20 and st.tokens_generated == 120 and st.retries == 0
        assert len(st.latencies_s) == 20 and st.tokens_per_s > 0
        assert st.engines_used == {"a": 10, "b": 10}, "least-outstanding scheduling splits evenly"
        assert all(s.finish_reason == "length" and s.weight_version == "0" for g in groups for s in g.samples)
        sent = SamplingParams(max_new_tokens=6, seed=a.calls[0][2].seed)
        assert a.calls[0][2] == sent, "sampling comes from cfg.rollout with a per-sample seed"
        await fleet.close()

    asyncio.run(main())


def test_dead_engine_requests_are_retried_elsewhere_exactly_once():
    async def main() -> None:
        a, b = FakeEngine("a"), FakeEngine("b", delay_s=0.001)
        fleet, mgr = await _setup(a, b)
        a.mode = "dead"  # admitted healthy, then its process dies: its requests are refused
        groups = await mgr.generate_groups(_prompts(range(4)))
        _assert_complete(groups, range(4), 4, 6)
        assert fleet.state_of("a") is EngineState.DEAD
        assert len(b.completed) == 16 and len(set(b.completed)) == 16, "every slot filled exactly once"
        assert mgr.last_stats.retries == len(a.calls) >= 1
        assert fleet.stats()["retried_requests"] == mgr.last_stats.retries
        assert mgr.last_stats.engines_used == {"b": 16}
        # The request-latency and retry series of Prometheus are fed from these stats, once per step.
        registry = MetricsRegistry("r", "driver")
        registry.publish_step(0, rollout_stats(mgr.last_stats))
        text = registry.exposition().decode()
        requests = float(len(mgr.last_stats.latencies_s))
        assert requests >= 16
        assert f'miles_lite_rollout_request_latency_seconds_count{{role="driver",run="r"}} {requests}' in text
        assert f'miles_lite_rollout_retried_requests_total{{role="driver",run="r"}} {float(len(a.calls))}' in text
        await fleet.close()

    asyncio.run(main())


def test_hanging_engine_times_out_and_is_retried():
    async def main() -> None:
        a, b = FakeEngine("a"), FakeEngine("b", delay_s=0.001)
        fleet, mgr = await _setup(a, b, request_timeout_s=0.3)
        a.mode = "hang"
        groups = await mgr.generate_groups(_prompts(range(2)), group_size=3)
        _assert_complete(groups, range(2), 3, 6)
        assert len(a.calls) >= 1 and mgr.last_stats.retries >= 1
        assert all(s.engine_id == "b" for g in groups for s in g.samples)
        await asyncio.sleep(0)  # let the best-effort abort of the timed-out request run
        await fleet.close()

    asyncio.run(main())


def test_retry_budget_is_bounded():
    async def main() -> None:
        rcfg, ft = _cfgs()
        ft.failure_threshold = 1000  # keep engines "healthy" so only the per-request budget applies
        ft.request_retries = 2
        fleet = EngineFleet(ft)
        for name in ("a", "b"):
            await fleet.add_engine(EngineHandle(FakeEngine(name, mode="error")))
        mgr = RolloutManager(fleet, rcfg, ft)
        with pytest.raises(RolloutError, match=r"failed 3 times \(fault_tolerance.request_retries=2\)"):
            await mgr.generate_groups(_prompts([0]), group_size=2)
        assert mgr.state.value == "idle"
        await fleet.close()

    asyncio.run(main())


def test_all_engines_dead_raises_fleet_exhausted():
    async def main() -> None:
        fleet, mgr = await _setup(FakeEngine("a", mode="error"))
        with pytest.raises(FleetExhausted):
            await mgr.generate_groups(_prompts([0]), group_size=2)
        await fleet.close()

    asyncio.run(main())


def test_abort_keeps_partials_and_resumes_them_under_new_weights():
    async def main() -> None:
        a, b = FakeEngine("a", delay_s=0.02), FakeEngine("b", delay_s=0.02)
        fleet, mgr = await _setup(a, b, max_new_tokens=20)
        run = asyncio.ensure_future(mgr.generate_groups(_prompts(range(3)), group_size=2))
        await fleet.wait_for(lambda: sum(r.inflight for r in fleet.records) == 6, 5.0)
        await asyncio.sleep(0.1)  # let every request produce a few tokens before the weight update
        await mgr.abort(timeout_s=5.0)
        first = await run
        assert first == [] and mgr.pending_groups == 3 and mgr.last_stats.aborted
        assert None in a.aborts and None in b.aborts
        for engine in (a, b):  # the weight update
            await engine.update_weights_from_disk("/ckpt/v1", "1")
            fleet.mark_synced(engine, "1")
        groups = await mgr.generate_groups([], group_size=2)
        assert mgr.pending_groups == 0 and mgr.last_stats.resumed_partials == 6
        assert [g.prompt_index for g in groups] == [0, 1, 2]
        for g in groups:
            for s in g.samples:
                assert len(s.response_ids) == len(s.rollout_logprobs) == 20
                assert s.weight_version == "0+1" and is_mixed_version(s)
                assert s.finish_reason == "length"
        # The continuation was sent as prompt + partial tokens with the remaining budget.
        rid, ids, params = a.calls[-1]
        assert len(ids) - 3 + params.max_new_tokens == 20 and ids[:2] == [1, 2]
        await fleet.close()

    asyncio.run(main())


def test_abort_when_idle_is_a_noop_and_concurrent_calls_are_refused():
    async def main() -> None:
        fleet, mgr = await _setup(FakeEngine("a", delay_s=0.01))
        await mgr.abort()
        run = asyncio.ensure_future(mgr.generate_groups(_prompts([0]), group_size=1))
        await asyncio.sleep(0)
        with pytest.raises(RuntimeError, match="one call at a time"):
            await mgr.generate_groups(_prompts([1]))
        assert len(await run) == 1
        await fleet.close()

    asyncio.run(main())


def _parity_scorer(groups: list[Group]) -> None:
    # Even prompts: every sample scores 0 (zero signal). Odd prompts: reward = parity of token 0.
    for g in groups:
        for s in g.samples:
            total = 0.0 if g.prompt_index % 2 == 0 else float(s.response_ids[0] % 2)
            s.rewards = {"parity": total, "total": total}


def test_dynamic_sampling_drops_zero_std_groups_and_refills():
    async def main() -> None:
        fleet, mgr = await _setup(FakeEngine("a"), FakeEngine("b"), dynamic_sampling=True, max_sampling_rounds=3)
        counter = iter(range(100, 1000))
        asked: list[int] = []

        def more(n: int) -> list[tuple[int, list[int], MathProblem]]:
            asked.append(n)
            return _prompts([next(counter) for _ in range(n)])

        groups = await mgr.generate_groups(_prompts(range(4)), group_size=2, scorer=_parity_scorer,
                                           more_prompts=more)
        assert len(groups) == 4 and not any(g.is_zero_signal for g in groups)
        assert all(g.prompt_index % 2 == 1 for g in groups)
        st = mgr.last_stats
        assert st.sampling_rounds >= 2 and st.dropped_groups >= 2 and asked[0] == 4
        with pytest.raises(ValueError, match="dynamic_sampling needs scorer"):
            await mgr.generate_groups(_prompts([0]), more_prompts=more)
        # A call without a refill source (evaluation, presample) is plain: every group comes back.
        plain = await mgr.generate_groups(_prompts([0, 2]), group_size=2, scorer=_parity_scorer)
        assert [g.prompt_index for g in plain] == [0, 2] and mgr.last_stats.dropped_groups == 0
        await fleet.close()

    asyncio.run(main())


def test_dynamic_sampling_stops_after_max_rounds():
    async def main() -> None:
        fleet, mgr = await _setup(FakeEngine("a"), dynamic_sampling=True, max_sampling_rounds=2)
        groups = await mgr.generate_groups(_prompts([0, 2]), group_size=2, scorer=_parity_scorer,
                                           more_prompts=lambda n: _prompts(range(10, 10 + 2 * n, 2)))
        assert groups == [] and mgr.last_stats.sampling_rounds == 2 and mgr.last_stats.dropped_groups > 2
        await fleet.close()

    asyncio.run(main())


def test_input_validation_names_the_field():
    with pytest.raises(ValueError, match="prompt_ids is empty"):
        as_prompt_spec((0, [], None))
    with pytest.raises(TypeError, match=r"\(prompt_index, prompt_ids, metadata\)"):
        as_prompt_spec([0, [1]])  # type: ignore[arg-type]
    rcfg, ft = _cfgs(max_new_tokens=0)
    with pytest.raises(ValueError, match="rollout.max_new_tokens"):
        RolloutManager(EngineFleet(ft), rcfg, ft)
    rcfg, ft = _cfgs()
    ft.request_retries = -1
    with pytest.raises(ValueError, match="request_retries"):
        RolloutManager(EngineFleet(ft), rcfg, ft)
    spec = as_prompt_spec((4, (5, 6), {"question": "q", "answer": 2, "prompt_text": "P"}))
    assert spec == PromptSpec(4, (5, 6), "P", "q", 2.0, ())


def test_sync_facade_and_rollout_table():
    rcfg, ft = _cfgs(max_new_tokens=3)
    with EventLoopThread() as loop:
        fleet = EngineFleet(ft)
        loop.run(fleet.add_engine(EngineHandle(FakeEngine("a", max_tokens=2))))
        sync = SyncRolloutManager(RolloutManager(fleet, rcfg, ft, decode=lambda ids: f"n={len(ids)}"), loop)
        groups = sync.generate_groups(_prompts([0, 1]), group_size=2, scorer=_parity_scorer)
        assert sync.last_stats.requests == 4
        loop.run(fleet.close())
    assert [len(g.samples) for g in groups] == [2, 2]
    groups[0].samples[0].response_ids, groups[0].samples[0].rollout_logprobs = [], []
    rows = rows_from_groups(7, groups)
    assert len(rows) == 4 and rows[1].step == 7 and rows[1].sample_index == 1
    assert rows[1].finish_reason == "stop" and rows[1].length == 2 and rows[1].completion == "n=2"
    assert math.isnan(rows[0].mean_logprob)
    lps = groups[1].samples[0].rollout_logprobs
    assert rows[2].mean_logprob == pytest.approx(sum(lps) / 2)
    assert [r.total for r in rows] == [s.reward for g in groups for s in g.samples]
    assert all(r.engine == "a" and r.weight_version == "0" and set(r.rewards) == {"parity"} for r in rows)


def test_rollout_rows_fit_the_parquet_writer(tmp_path):
    from miles_lite.observability.rollout_table import SCHEMA, RolloutTableWriter, read_rollouts

    group = Group(0, "P", "q", 1.0, (), [
        Sample(0, [1], [2, 3], [-0.5, -1.5], "c", "stop", "a+b", "0+1", {"x": 1.0, "total": 2.0})])
    rows = rows_from_groups(3, [group])
    assert all(hasattr(rows[0], name) for name in SCHEMA.names)
    RolloutTableWriter(tmp_path).write_step(3, rows)
    table = read_rollouts(tmp_path).to_pylist()
    assert table[0]["weight_version"] == "0+1" and table[0]["mean_logprob"] == -1.0 and table[0]["total"] == 2.0
