"""Plug-in calls off the rollout loop: the worker pool and its time limits, a slow tool that delays only its own
trajectory, and reward functions bounded by `rewards.timeout_s`."""

from __future__ import annotations

import asyncio
import time

import pytest

from miles_lite.config.schema import FaultToleranceConfig, RolloutConfig
from miles_lite.plugins import PluginFailed, PluginPool, PluginTimeout
from miles_lite.rewards.batch import RewardBatch, call_style
from miles_lite.rewards.registry import RegisteredReward, RewardSet, score_batch
from miles_lite.rollout.fleet import EngineFleet, EngineHandle
from miles_lite.rollout.manager import RolloutManager
from miles_lite.rollout.prompt_spec import PromptSpec
from miles_lite.types import Generation, SamplingParams


def test_pool_calls_return_and_time_out():
    pool = PluginPool(workers=2, timeout_s=0.3)
    try:
        assert pool.call("add", lambda a, b: a + b, (2, 3)) == 5
        with pytest.raises(PluginTimeout, match="slow did not return within 0.3s"):
            pool.call("slow", time.sleep, (2,))

        async def main() -> list[float]:
            ticks: list[float] = []

            async def ticker() -> None:
                for _ in range(5):
                    ticks.append(time.monotonic())
                    await asyncio.sleep(0.02)

            start = time.monotonic()
            task = asyncio.ensure_future(ticker())
            assert await pool.acall("sleep", time.sleep, (0.2,), timeout_s=1.0) is None
            await task
            return [t - start for t in ticks]

        # The loop kept ticking while the blocking call ran in the pool.
        assert max(asyncio.run(main())) < 0.2
    finally:
        pool.close()


def _double(values):
    return [2 * v for v in values]


def test_process_pool_runs_picklable_calls():
    pool = PluginPool(workers=1, kind="processes", timeout_s=60)
    try:
        assert pool.call("double", _double, ([1, 2],)) == [2, 4]
    finally:
        pool.close()


# ------------------------------------------------------------------ a slow tool delays its own trajectory only

def encode(text: str) -> list[int]:
    return [ord(c) for c in text]


def decode(ids) -> str:
    return "".join(chr(i) for i in ids)


class ToolEngine:
    """Each prompt's first turn calls the tool; after the tool's reply the model answers."""

    engine_id, url = "tool-engine", "fake://tool"

    async def generate(self, input_ids, sampling: SamplingParams, *, rid=None) -> Generation:
        text = decode(input_ids)
        out = "done" if text.endswith("</r>") else "<t>go</t>"
        await asyncio.sleep(0.01)  # decode time
        return Generation(tuple(encode(out)), tuple(-0.1 for _ in out), "stop", "1", self.engine_id)

    async def health(self, timeout_s: float) -> bool:
        return True

    async def abort(self, rid=None) -> None:
        return None


class SlowForOne:
    """A tool that blocks (time.sleep: not awaitable) for 2 s on prompt 0's trajectories, answers at once otherwise."""

    stop = ("</t>",)

    def reply(self, turn: str, question: str) -> str | None:
        if not turn.endswith("</t>"):
            return None
        if question == "q0":
            time.sleep(2.0)
        return "<r>ok</r>"


def test_a_two_second_tool_call_delays_only_its_own_trajectory():
    env = SlowForOne()

    async def main() -> None:
        ft = FaultToleranceConfig(health_interval_s=60, request_retries=0)
        fleet = EngineFleet(ft)
        await fleet.add_engine(EngineHandle(ToolEngine()))
        manager = RolloutManager(fleet, RolloutConfig(group_size=2, max_new_tokens=64, max_turns=3), ft,
                                 decode=decode, encode=encode, environment=env)
        prompts = [PromptSpec(i, tuple(encode(f"q{i}:")), f"q{i}", f"q{i}") for i in range(8)]
        latencies: dict[int, float] = {}
        orig_fill = manager._fill_slot

        async def fill(group, slot, stats):
            t0 = time.monotonic()
            await orig_fill(group, slot, stats)
            latencies.setdefault(group.spec.prompt_index, 0.0)
            latencies[group.spec.prompt_index] = max(latencies[group.spec.prompt_index], time.monotonic() - t0)

        manager._fill_slot = fill  # type: ignore[method-assign]
        groups = await manager.generate_groups(prompts)
        await fleet.close()
        assert all(len(g.samples) == 2 and g.samples[0].turns == 2 for g in groups)
        # The slow prompt's trajectories took their 2 s; the 14 others were done long before (the loop
        # served them while the tool blocked a worker thread).
        assert latencies[0] >= 2.0
        others = [latencies[i] for i in range(1, 8)]
        assert max(others) < 2.0, others  # (~0.1 s each on an idle machine; a stalled loop would add the 2 s)

    asyncio.run(main())


def test_an_environment_call_past_its_limit_fails_the_rollout_naming_it():
    class Hangs(SlowForOne):
        def reply(self, turn, question):
            time.sleep(5)

    async def main() -> None:
        ft = FaultToleranceConfig(health_interval_s=60, request_retries=0)
        fleet = EngineFleet(ft)
        await fleet.add_engine(EngineHandle(ToolEngine()))
        manager = RolloutManager(fleet, RolloutConfig(group_size=1, plugin_timeout_s=0.2), ft, decode=decode,
                                 encode=encode, environment=Hangs())
        try:
            with pytest.raises(PluginFailed, match=r"rollout.environment failed: PluginTimeout: rollout.environment "
                                                   r"reply\(\) did not return within 0.2s"):
                await manager.generate_groups([PromptSpec(0, tuple(encode("q:")), "q", "q")])
        finally:
            await fleet.close()

    asyncio.run(main())


# ------------------------------------------------------------------ reward functions in the pool, bounded

def _slow_reward(completions, **kwargs):
    time.sleep(2)
    return [1.0] * len(completions)


async def _async_slow_reward(completions, **kwargs):
    await asyncio.sleep(2)
    return [1.0] * len(completions)


@pytest.mark.parametrize("fn", [_slow_reward, _async_slow_reward])
def test_a_reward_past_rewards_timeout_fails_naming_the_reward(fn):
    pool = PluginPool(workers=2, timeout_s=60)
    batch = RewardBatch(["a", "b"], [1.0, 2.0], ["q", "q"], [(), ()])
    rewards = RewardSet("mine", {"slow": 1.0}, {"slow": RegisteredReward(fn, style="columns")}).run_in(pool, 0.2)
    try:
        with pytest.raises(PluginFailed, match=r"reward 'slow' failed: PluginTimeout: reward 'slow' did not return "
                                               r"within 0.2s"):
            score_batch(rewards, batch)
        assert call_style(lambda completions, **kw: [0.5] * len(completions), "columns", batch, 1.0, pool) == [0.5] * 2
    finally:
        pool.close()
