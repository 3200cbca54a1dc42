"""TRL's reward convention at the reward seam, with TRL's own functions: conversational records get message
lists both ways, string records strings; `trainer_state`, `log_metric` and `log_extra` are passed and land
where a run reports them; `rewards.custom` takes several plug-ins and factories with their arguments; a bare
factory is refused with the call to write; a sample is right when it reached each reward's best."""

from __future__ import annotations

import math
import sys
import types

import pytest
from trl.rewards import (
    accuracy_reward,
    get_repetition_penalty_reward,
    get_soft_overlong_punishment,
    think_format_reward,
)

from miles_lite.config.schema import MilesConfig
from miles_lite.data.records import Record
from miles_lite.data.source import PromptSource
from miles_lite.evaluation.sets import summarise_set
from miles_lite.observability.rollout_table import rows_from_groups
from miles_lite.plugins import PluginError
from miles_lite.rewards import score_groups
from miles_lite.rewards.context import RewardContext
from miles_lite.rewards.setup import build_reward_set
from miles_lite.rewards.specs import custom_specs
from miles_lite.rewards.success import right_flags
from miles_lite.run.reward_log import RewardLog
from miles_lite.types import Group, Sample

SEEN: list[dict] = []


def spy(prompts, completions, completion_ids, trainer_state, log_metric, log_extra, **kwargs):
    SEEN.append({"prompts": prompts, "completions": completions, "ids": completion_ids, "state": trainer_state,
                 "kwargs": kwargs})
    log_metric("spy/seen", float(len(completions)))
    log_extra("length", [len(c) if isinstance(c, str) else len(c[0]["content"]) for c in completions])
    return [1.0] * len(completions)


def scheduled(completions, trainer_state, **kwargs):
    """A reward whose weight follows training progress, as TRL's docs show with `trainer_state`."""
    return [trainer_state.global_step / trainer_state.max_steps] * len(completions)


def factory_without_annotation(scale):
    def reward(completions, **kwargs):
        return [scale] * len(completions)
    return reward


@pytest.fixture(autouse=True)
def plugin_module():
    module = types.ModuleType("trl_plugins")
    for fn in (spy, scheduled, factory_without_annotation):
        setattr(module, fn.__name__, fn)
    sys.modules["trl_plugins"] = module
    SEEN.clear()
    yield
    del sys.modules["trl_plugins"]


CHAT = [{"role": "developer", "content": [{"type": "text", "text": "Think first."}]},
        {"role": "user", "content": "What is 1+2?"}]


def chat_record(solution: str = "3") -> Record:
    messages = ({"role": "developer", "content": "Think first."}, {"role": "user", "content": "What is 1+2?"})
    return Record(None, messages, None, {"prompt": CHAT, "solution": solution}, where="d.jsonl: line 1",
                  prompt_value=CHAT)


def string_record() -> Record:
    return Record("1+2=", None, None, {"prompt": "1+2=", "solution": "3"}, prompt_value="1+2=")


def group(record: Record, *completions: str, ids: list[list[int]] | None = None) -> Group:
    samples = [Sample(0, [1, 2], (ids or [[7] * (i + 1) for i in range(len(completions))])[i], [0.0],
                      response_text=c) for i, c in enumerate(completions)]
    return Group(0, "p", record.question, record.answer, (), samples, record=record)


def test_conversational_records_pass_message_lists_both_ways_and_string_records_strings() -> None:
    reward_set = build_reward_set("none", {}, "trl_plugins:spy")
    score_groups(reward_set, [group(chat_record(), "a", "bb"), group(string_record(), "ccc")])
    (call,) = SEEN
    # The prompt exactly as the data holds it (typed parts and the developer role unchanged), as TRL passes it.
    assert call["prompts"] == [CHAT, CHAT, "1+2="]
    assert call["completions"] == [[{"role": "assistant", "content": "a"}], [{"role": "assistant", "content": "bb"}],
                                   "ccc"]
    assert call["ids"] == [[7], [7, 7], [7]]
    assert call["kwargs"]["solution"] == ["3", "3", "3"]


def test_trls_shipped_rewards_run_unchanged_on_conversational_records() -> None:
    reward_set = build_reward_set("none", {}, ["trl.rewards:accuracy_reward", "trl.rewards:think_format_reward"])
    (g,) = score_groups(reward_set, [group(chat_record(r"\frac{1}{3}"), r"<think>x</think> \boxed{\frac{1}{3}}",
                                           r"\boxed{\frac{1}{2}}")])
    assert [s.rewards["accuracy_reward"] for s in g.samples] == [1.0, 0.0]
    assert [s.rewards["think_format_reward"] for s in g.samples] == [1.0, 0.0]
    assert [s.reward for s in g.samples] == [2.0, 0.0]
    # accuracy_reward logs its parse with log_extra: it reaches each sample, and the rollout table.
    assert g.samples[0].extra["solution"] == r"\frac{1}{3}" and "gold_parsed" in g.samples[0].extra
    row = rows_from_groups(4, [g])[0]
    assert row.extra["solution"] == r"\frac{1}{3}"
    assert accuracy_reward is not None and think_format_reward is not None


def test_trainer_state_and_log_metric_reach_the_plugins_and_the_step() -> None:
    cfg = MilesConfig()
    cfg.experiment.steps = 40
    data = PromptSource([string_record()] * 4, seed=0)
    data.next_batch(2)
    log = RewardLog(cfg, data)
    log.steps_done = 10
    reward_set = build_reward_set("none", {}, ["trl_plugins:spy", "trl_plugins:scheduled"])
    (g,) = log.score(reward_set, [group(string_record(), "x", "yy")])
    state = SEEN[0]["state"]
    assert (state.global_step, state.max_steps, state.epoch) == (10, 40, 0.5)
    assert state.train_batch_size == cfg.rollout.prompts_per_step * cfg.rollout.group_size
    assert [s.rewards["scheduled"] for s in g.samples] == [0.25, 0.25]
    log.score(reward_set, [group(string_record(), "z")])
    assert log.drain() == {"log_metric/spy/seen": 1.5}
    assert log.drain() == {}
    assert [s.extra["length"] for s in g.samples] == [1, 2]


def test_log_extra_with_by_source_routes_values_to_the_scored_rows() -> None:
    a, b = string_record(), chat_record()
    a = Record(a.prompt, None, None, {**a.columns, "data_source": "a"}, "a", prompt_value=a.prompt_value)
    b = Record(None, b.messages, None, {**b.columns, "data_source": "b"}, "b", prompt_value=b.prompt_value)
    reward_set = build_reward_set("none", {}, None, None, {"b": "trl_plugins:spy"})
    ga, gb = score_groups(reward_set, [group(a, "skip"), group(b, "four")])
    assert ga.samples[0].extra == {} and gb.samples[0].extra == {"length": 4}
    context = RewardContext()
    with pytest.raises(ValueError, match=r"log_extra\('c', \.\.\.\) got 1 values for the 2 completions"):
        context.extra_logger([0, 1])("c", [1])


def test_factories_are_called_with_their_arguments_in_either_form() -> None:
    reward_set = build_reward_set("none", {"soft_overlong_punishment_reward": 0.5}, [
        "trl.rewards:get_soft_overlong_punishment(max_completion_len=4, soft_punish_cache=2)",
        {"fn": "trl.rewards:get_repetition_penalty_reward", "kwargs": {"ngram_size": 2}, "max_value": 0.0},
    ])
    assert dict(reward_set.weights) == {"soft_overlong_punishment_reward": 0.5, "repetition_penalty_reward": 1.0}
    (g,) = score_groups(reward_set, [group(string_record(), "a", "b", "c", ids=[[1, 2], [1, 2, 3], [5, 5, 5, 5, 5]])])
    assert [s.rewards["soft_overlong_punishment_reward"] for s in g.samples] == [0.0, -0.5, -1.0]
    assert [s.rewards["repetition_penalty_reward"] for s in g.samples] == [0.0, 0.0, -0.75]
    assert get_soft_overlong_punishment(4, 2)([[1, 2, 3]]) == [-0.5]
    assert get_repetition_penalty_reward(2)([[5, 5, 5, 5, 5]]) == [-0.75]
    assert reward_set.reward("repetition_penalty_reward").max_value == 0.0
    assert reward_set.reward("soft_overlong_punishment_reward").max_value is None
    # The same factory twice: a block names the second.
    twice = build_reward_set("none", {}, ["trl_plugins:factory_without_annotation(0.5)",
                                          {"fn": "trl_plugins:factory_without_annotation", "kwargs": {"scale": 2},
                                           "name": "double"}])
    assert set(twice.weights) == {"reward", "double"}


@pytest.mark.parametrize(("custom", "message"), [
    ("trl.rewards:get_soft_overlong_punishment",
     r"rewards.custom='trl.rewards:get_soft_overlong_punishment': .*must accept \*\*kwargs.*; it returns a Callable, "
     r"so it is a factory: call it with its arguments, rewards.custom='trl.rewards:get_soft_overlong_punishment\("
     r"max_completion_len=\.\.\., soft_punish_cache=\.\.\.\)', or a block "
     r"\{fn: trl.rewards:get_soft_overlong_punishment, kwargs: "
     r"\{max_completion_len: \.\.\., soft_punish_cache: \.\.\.\}\}"),
    ("trl_plugins:factory_without_annotation", r"; if it is a factory: call it with its arguments, "
     r"rewards.custom='trl_plugins:factory_without_annotation\(scale=\.\.\.\)'"),
    ("trl.rewards:get_soft_overlong_punishment(max_completion_len=4)",
     r"the factory raised TypeError: .*soft_punish_cache"),
    ("trl.rewards:get_repetition_penalty_reward(max_penalty=abs)", r"arguments must be literals.*'abs'"),
    ("trl.rewards:get_repetition_penalty_reward(max_penalty=1.0)", r"the factory raised ValueError"),
    ("trl.rewards:get_repetition_penalty_reward(**x)", r"name each argument"),
    ("trl.rewards:get_repetition_penalty_reward(", r"cannot read the factory's arguments"),
    ({"fn": "trl.rewards:think_format_reward", "weight": 2}, r"rewards.custom: unknown key\(s\) \['weight'\]"),
    ({"fn": "trl.rewards:get_repetition_penalty_reward(ngram_size=2)", "kwargs": {"ngram_size": 3}},
     r"give the factory's arguments once"),
    ([{"fn": "trl.rewards:think_format_reward", "max_value": "high"}],
     r"rewards.custom\[0\].max_value must be a finite"),
    (["trl.rewards:think_format_reward", "trl.rewards:think_format_reward"],
     r"rewards.custom\[1\]=.*already has a reward named 'think_format_reward'; rename the function"),
])
def test_bad_entries_are_refused_naming_the_entry_and_the_fix(custom, message: str) -> None:
    with pytest.raises(PluginError, match=message):
        build_reward_set("none", {}, custom)


def test_specs_of_each_form() -> None:
    one, two = custom_specs(["m:f", "m:g(1, 'a', k=[1, 2], flag=None)"])
    assert (one.path, one.call, one.field) == ("m:f", False, "rewards.custom[0]")
    assert (two.path, two.args, dict(two.kwargs)) == ("m:g", (1, "a"), {"k": [1, 2], "flag": None})
    assert two.shown == "m:g(1, 'a', k=[1, 2], flag=None)"
    assert custom_specs(None) == [] and custom_specs("m:f")[0].field == "rewards.custom"


def test_a_sample_is_right_when_it_reached_each_rewards_best() -> None:
    # An overlong penalty (best 0, undeclared) beside a declared 0/1 reward: right = correct and not penalised.
    reward_set = build_reward_set("none", {}, [
        "trl.rewards:get_soft_overlong_punishment(max_completion_len=4, soft_punish_cache=2)",
        {"fn": "trl.rewards:think_format_reward", "max_value": 1.0}])
    rows = [{"soft_overlong_punishment_reward": 0.0, "think_format_reward": 1.0, "total": 1.0},
            {"soft_overlong_punishment_reward": -0.5, "think_format_reward": 1.0, "total": 0.5},
            {"soft_overlong_punishment_reward": 0.0, "think_format_reward": 0.0, "total": 0.0},
            {"soft_overlong_punishment_reward": math.nan, "think_format_reward": math.nan, "total": 0.0}]
    assert right_flags(reward_set, rows, [None] * 4) == [True, False, False, False]
    assert right_flags(reward_set, rows, [None] * 4, threshold=0.5) == [True, True, False, False]
    # Only penalties: nothing reaches a declared 1.0, but the best seen (0) counts.
    penalty = build_reward_set("none", {}, "trl.rewards:get_repetition_penalty_reward(ngram_size=2)")
    (g,) = score_groups(penalty, [group(string_record(), "a", "b", ids=[[1, 2, 3], [5, 5, 5]])])
    result = summarise_set("dev", [g], 2, penalty, None)
    assert result.avg_at_k == 0.5 and result.pass_at[2] == 1.0
