"""A plug-in that fails while the run uses it (group filter, tool environment, generate function, the remote
reward model past its retries) raises `PluginFailed` naming it, with the plug-in's own exception as the
cause; the engines' failures inside a generate plug-in stay the rollout's own."""

from __future__ import annotations

import asyncio
import socket

import pytest
from fake_rollout_engine import FakeEngine
from test_multi_turn import PROMPT, SCRIPT, ScriptedEngine, decode, encode

from miles_lite.config.schema import FaultToleranceConfig, RolloutConfig
from miles_lite.data.gsm8k import MathProblem
from miles_lite.plugins import PluginFailed
from miles_lite.rewards.registry import score
from miles_lite.rewards.remote import RemoteRewardSpec
from miles_lite.rewards.setup import build_reward_set
from miles_lite.rollout.fleet import EngineFleet, EngineHandle
from miles_lite.rollout.generate_plugin import GenerateResult
from miles_lite.rollout.manager import RolloutError, RolloutManager
from miles_lite.rollout.prompt_spec import PromptSpec


def _run(engine, coro_fn, **kwargs):
    async def main():
        ft = FaultToleranceConfig(health_interval_s=60, request_retries=0)
        fleet = EngineFleet(ft)
        manager = RolloutManager(fleet, RolloutConfig(group_size=2, max_new_tokens=64, dynamic_sampling=True), ft,
                                 decode=decode, encode=encode, **kwargs)
        await fleet.add_engine(EngineHandle(engine))
        try:
            return await coro_fn(manager)
        finally:
            await fleet.close()

    return asyncio.run(main())


def _spec() -> PromptSpec:
    return PromptSpec(0, tuple(encode(PROMPT)), PROMPT, "2*3?", 6.0, ())


def test_a_raising_group_filter_fails_as_plugin_failed() -> None:
    def picky(group):
        raise KeyError("no such column")

    def more(n):
        return [(i, [1, 2], MathProblem(f"q{i}", f"#### {i}", float(i))) for i in range(n)]

    async def go(manager):
        return await manager.generate_groups([(0, [1, 2, 3], MathProblem("q", "#### 1", 1.0))], group_size=2,
                                             scorer=lambda groups: None, more_prompts=more)

    with pytest.raises(PluginFailed, match=r"^rollout.group_filter failed: KeyError: 'no such column'") as failed:
        _run(FakeEngine("a"), go, group_filter=picky)
    assert isinstance(failed.value.__cause__, KeyError)


class _BrokenTool:
    stop = ("</calc>",)

    def reply(self, turn, question):
        raise ZeroDivisionError("tool crashed")


class _WrongTypeTool:
    stop = ("</calc>",)

    def reply(self, turn, question):
        return 6


@pytest.mark.parametrize(("env", "message"), [(_BrokenTool(), "ZeroDivisionError: tool crashed"),
                                              (_WrongTypeTool(), "TypeError: reply\\(\\) returned int")])
def test_a_failing_environment_fails_as_plugin_failed(env, message: str) -> None:
    async def go(manager):
        return await manager.generate_groups([_spec()], group_size=1)

    with pytest.raises(PluginFailed, match=f"^rollout.environment failed: {message}"):
        _run(ScriptedEngine(SCRIPT), go, environment=env)


async def _raising_generate(client, prompt, sampling):
    raise ValueError("bad plug-in")


async def _wrong_result(client, prompt, sampling):
    return [1, 2, 3]


async def _bad_lengths(client, prompt, sampling):
    return GenerateResult([1, 2], [0.0], [1, 1], "stop")


async def _engine_failure(client, prompt, sampling):
    return await client.generate(list(prompt.prompt_ids), sampling)


@pytest.mark.parametrize(("fn", "message"), [(_raising_generate, "ValueError: bad plug-in"),
                                             (_wrong_result, "TypeError: returned list, expected a GenerateResult"),
                                             (_bad_lengths, "ValueError: ")])
def test_a_failing_generate_plugin_fails_as_plugin_failed(fn, message: str) -> None:
    async def go(manager):
        return await manager.generate_groups([_spec()], group_size=1)

    with pytest.raises(PluginFailed, match=f"^rollout.generate_fn failed: {message}"):
        _run(ScriptedEngine(SCRIPT), go, generate_fn=fn)


def test_engine_failures_inside_a_generate_plugin_stay_rollout_errors() -> None:
    async def go(manager):
        return await manager.generate_groups([_spec()], group_size=1)

    with pytest.raises(RolloutError):
        _run(FakeEngine("a", mode="error"), go, generate_fn=_engine_failure)


def test_a_remote_reward_model_down_past_its_retries_fails_as_plugin_failed() -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}/score"
    spec = RemoteRewardSpec(url, name="judge", retries=1, backoff_s=0.0, timeout_s=2.0)
    reward_set = build_reward_set("correctness_only", {}, remote=spec)
    with pytest.raises(PluginFailed, match=r"^reward 'judge' failed: RemoteRewardError: reward service "
                                           rf"{url} failed batch 0 \(1 completions\) 2 times") as failed:
        score(reward_set, ["<SOLUTION>6</SOLUTION>"], [6.0], ["2*3?"], [()])
    assert failed.value.plugin == "reward 'judge'"
