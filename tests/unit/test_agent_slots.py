"""Agents as rollout slots: the sample is the session (ids, mask, log-probs, turns), what the agent returned
reaches the rewards, failed and timed-out agents are dropped and counted, a blocking tool in one agent delays
no other, and a call whose agents all fail ends as a failed plug-in."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from miles_lite.data.records import Record
from miles_lite.formats.chat import load_chat_template
from miles_lite.plugins import PluginFailed
from miles_lite.rewards import score_groups
from miles_lite.rewards.setup import build_reward_set
from miles_lite.rollout.agent_slots import start_agent_slots, stop_agent_slots
from miles_lite.rollout.prompt_spec import PromptSpec
from tests.unit import agents_for_tests
from tests.unit.gateway_harness import KEY, harness

pytestmark = pytest.mark.timeout(120)


def _record(question: str, label: str, **meta) -> Record:
    messages = ({"role": "system", "content": "Use lookup."}, {"role": "user", "content": f"{question}?"})
    return Record(None, messages, label, {"messages": list(messages), "label": label, "metadata": meta})


def _specs(h, records):
    return [PromptSpec(i, (1,), record=r) for i, r in enumerate(records)]


def _run(h, records, agent="tests.unit.agents_for_tests:tool_agent", group_size=2, **rollout):
    cfg = replace(h.manager.cfg, agent=agent, group_size=group_size, **rollout)
    h.manager.cfg = cfg
    tok = h.tokenizer
    slots = h.loop.run(start_agent_slots(h.manager, cfg, load_chat_template("qwen2.5"),
                                         lambda t: list(tok(t, add_special_tokens=False)["input_ids"]), tok.decode,
                                         KEY, "policy"))
    try:
        return h.loop.run(h.manager.generate_groups(_specs(h, records)))
    finally:
        h.loop.run(stop_agent_slots(slots))
        h.manager.agents = None


def test_an_agents_session_becomes_the_sample_and_its_reward_is_scored(tmp_path: Path):
    with harness(tmp_path) as h:
        groups = _run(h, [_record("kiwi", "7"), _record("fig", "3")])
        stats = h.manager.last_stats
        assert (stats.agents_started, stats.agents_succeeded, stats.agent_turns) == (4, 4, 4 * 3 - 2)
        requests = {tuple(inp + out): (inp, out) for inp, out in h.engines[0].requests}
        for group in groups:
            assert len(group.samples) == 2
            for sample in group.samples:
                ids = tuple(sample.prompt_ids + sample.response_ids)
                assert ids in requests  # the sample ends with the engine's last answer, exactly
                assert sample.loss_mask is not None and sum(sample.loss_mask) < len(sample.response_ids)
                assert sample.turns == (3 if group.prompt_index == 0 else 2)
                assert sample.agent["reward"] == 1.0 and sample.agent["turns_used"] == sample.turns
        rewards = build_reward_set("none", {}, agent=True)
        score_groups(rewards, groups)
        assert all(s.rewards == {"agent": 1.0, "total": 1.0} for g in groups for s in g.samples)


def test_failed_and_timed_out_agents_are_dropped_counted_and_aborted(tmp_path: Path):
    agents_for_tests.ABORTS.clear()
    with harness(tmp_path) as h:
        records = [_record("kiwi", "7", name="ok"), _record("kiwi", "7", fail=True, name="fails"),
                   _record("fig", "3", hang_s=10.0, name="hangs")]
        # The limit leaves the other agents' three turns room on a loaded machine.
        groups = _run(h, records, agent_timeout_s=3.0, agent_abort="tests.unit.agents_for_tests:note_abort")
        stats = h.manager.last_stats
        counts = (stats.agents_started, stats.agents_succeeded, stats.agents_failed, stats.agents_timed_out)
        assert counts == (6, 2, 2, 2)
        assert [len(g.samples) for g in groups] == [2, 0, 0]
        assert sorted(agents_for_tests.ABORTS) == [("fails", "failed")] * 2 + [("hangs", "timeout")] * 2


def test_a_call_whose_agents_all_fail_ends_as_a_failed_plugin(tmp_path: Path):
    with harness(tmp_path) as h:
        with pytest.raises(PluginFailed, match=r"rollout.agent failed: .*all 2 agents of the rollout failed; the "
                                               r"first: RuntimeError: the agent broke"):
            _run(h, [_record("kiwi", "7", fail=True)])
        with pytest.raises(PluginFailed, match="without a chat completion request"):
            _run(h, [_record("kiwi", "7")], agent="tests.unit.agents_for_tests:no_request_agent")


def test_a_blocking_two_second_tool_in_one_agent_delays_no_other(tmp_path: Path):
    with harness(tmp_path) as h:
        for engine in h.engines:
            engine.delay_s = 0.01
        records = [_record("kiwi", "7", slow_s=2.0)] + [_record("kiwi", "7") for _ in range(5)]
        groups = _run(h, records, group_size=2)
        seconds = {g.prompt_index: [s.agent["seconds"] for s in g.samples] for g in groups}
        assert min(seconds[0]) >= 4.0  # two tool calls of 2 s each
        others = [t for i in range(1, 6) for t in seconds[i]]
        assert max(others) < 2.0, others  # a stalled loop would add the tool's 2 s to each


def test_an_abort_stops_the_agents_and_their_slots_run_again_in_the_next_call(tmp_path: Path):
    import asyncio

    with harness(tmp_path) as h:
        for engine in h.engines:
            engine.delay_s = 0.2  # turns long enough for the abort to find agents mid-session
        cfg = replace(h.manager.cfg, agent="tests.unit.agents_for_tests:tool_agent", group_size=2)
        h.manager.cfg = cfg
        tok = h.tokenizer
        slots = h.loop.run(start_agent_slots(h.manager, cfg, load_chat_template("qwen2.5"),
                                             lambda t: list(tok(t, add_special_tokens=False)["input_ids"]),
                                             tok.decode, KEY, "policy"))

        async def interrupted():
            call = asyncio.ensure_future(h.manager.generate_groups(_specs(h, [_record("kiwi", "7")] * 3)))
            await asyncio.sleep(0.3)
            await h.manager.abort(timeout_s=30)
            return await call

        try:
            assert h.loop.run(interrupted()) == []
            assert h.manager.pending_groups == 3 and not h.gateway.sessions
            groups = h.loop.run(h.manager.generate_groups([]))
        finally:
            h.loop.run(stop_agent_slots(slots))
            h.manager.agents = None
        assert [len(g.samples) for g in groups] == [2, 2, 2]
        assert all(s.turns == 3 and s.agent["reward"] == 1.0 for g in groups for s in g.samples)


def test_a_moe_session_sample_carries_the_last_turns_routed_experts_for_every_response_position(tmp_path: Path):
    import numpy as np

    from miles_lite.rollout.routing import RoutingLayout

    with harness(tmp_path) as h:
        h.manager.routing = RoutingLayout(num_hidden_layers=2, moe_layers=(0, 1), top_k=2, num_experts=8)
        (group,) = _run(h, [_record("kiwi", "7")])
        for sample in group.samples:
            assert sample.prompt_ids + sample.response_ids in (inp + out for inp, out in h.engines[0].requests)
            p, r = len(sample.prompt_ids), len(sample.response_ids)
            assert sample.routed_experts.shape == (r - 1, 2, 2)
            # Row i of the sample is position P + i of the sequence: the engine's ids for that position.
            rows = p + r - 1
            flat = (np.arange(rows * 4) // 4 + np.tile(np.arange(4), rows)) % 8
            assert np.array_equal(sample.routed_experts, flat.reshape(rows, 2, 2)[p:].astype(np.int8))
