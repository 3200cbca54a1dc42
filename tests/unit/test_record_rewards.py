"""Rewards on records: TRL-style plug-ins get every column, None is left out, async functions are
awaited, `rewards.by_source` routes by data source, the built-in record rewards, the start-up check of
rewards against the data, and the evaluation sets' measures."""

from __future__ import annotations

import asyncio
import math
import sys
import types

import pytest

from miles_lite.data.records import Record
from miles_lite.evaluation.sets import pass_points, summarise_set
from miles_lite.plugins import PluginError
from miles_lite.rewards import score_groups
from miles_lite.rewards.batch import batch_from_records, columns_problem, reward_style
from miles_lite.rewards.records import ExactMatch, boxed_text, math_answer
from miles_lite.rewards.setup import build_reward_set
from miles_lite.rollout.environment import start_trajectory
from miles_lite.run.rl_batch import reward_stats
from miles_lite.types import Group, Sample

SEEN: dict[str, list] = {}


def trl_reward(prompts, completions, completion_ids, label, meta, data_source, **kwargs):
    SEEN["call"] = [prompts, completions, completion_ids, label, meta, data_source, kwargs]
    return [1.0 if c == y else None if c == "skip" else 0.0 for c, y in zip(completions, label, strict=True)]


async def async_reward(completions, **kwargs):
    await asyncio.sleep(0)
    return [0.5] * len(completions)


def only_a(completions, data_source, **kwargs):
    assert set(data_source) == {"a"}
    return [1.0] * len(completions)


def only_b(completions, data_source, **kwargs):
    assert set(data_source) == {"b"}
    return [0.25] * len(completions)


only_b.max_value = 1.0  # declared: evaluation compares with it rather than with the best seen


def no_kwargs(completions, label):
    return [0.0] * len(completions)


@pytest.fixture(autouse=True)
def plugin_module():
    module = types.ModuleType("record_plugins")
    for fn in (trl_reward, async_reward, only_a, only_b, no_kwargs):
        setattr(module, fn.__name__, fn)
    sys.modules["record_plugins"] = module
    yield
    del sys.modules["record_plugins"]


def record(label, source="a", prompt="p", **extra) -> Record:
    columns = {"prompt": prompt, "label": label, "meta": {"n": 1}, "data_source": source, **extra}
    return Record(prompt, None, label, columns, source)


def group(rec: Record, *completions: str) -> Group:
    samples = [Sample(0, [1], [i + 5], [0.0], response_text=c) for i, c in enumerate(completions)]
    return Group(0, "p", rec.question, rec.answer, (), samples, record=rec)


def test_trl_plugin_gets_every_column_by_name_and_none_is_left_out_of_the_total() -> None:
    reward_set = build_reward_set("none", {}, "record_plugins:trl_reward")
    (g,) = score_groups(reward_set, [group(record("yes", tests=[1, 2]), "yes", "no", "skip")])
    prompts, completions, ids, label, meta, source, kwargs = SEEN["call"]
    assert prompts == ["p"] * 3 and completions == ["yes", "no", "skip"] and ids == [[5], [6], [7]]
    assert label == ["yes"] * 3 and meta == [{"n": 1}] * 3 and source == ["a"] * 3
    # TRL's keywords besides the columns: the trainer state and the two loggers.
    assert set(kwargs) == {"prompt", "tests", "trainer_state", "log_metric", "log_extra"}
    assert kwargs["prompt"] == ["p"] * 3 and kwargs["tests"] == [[1, 2]] * 3
    values = [s.rewards["trl_reward"] for s in g.samples]
    assert values[:2] == [1.0, 0.0] and math.isnan(values[2])
    assert [s.reward for s in g.samples] == [1.0, 0.0, 0.0]
    stats = reward_stats([g])
    assert stats["reward/values/trl_reward"] == [1.0, 0.0] and stats["reward/none/trl_reward"] == 1.0
    assert stats["reward/unscored_samples"] == 1.0 and stats["reward/mean"] == 0.5


def test_async_rewards_are_awaited_also_inside_a_running_event_loop() -> None:
    reward_set = build_reward_set("none", {}, "record_plugins:async_reward")
    (g,) = score_groups(reward_set, [group(record("x"), "a", "b")])
    assert [s.reward for s in g.samples] == [0.5, 0.5]

    async def inside_loop() -> list[float]:
        (h,) = score_groups(reward_set, [group(record("x"), "c")])
        return [s.reward for s in h.samples]

    assert asyncio.run(inside_loop()) == [0.5]


def test_by_source_routes_each_record_to_its_function() -> None:
    reward_set = build_reward_set("none", {}, None, None, {"a": "record_plugins:only_a", "b": "record_plugins:only_b"})
    ga, gb = score_groups(reward_set, [group(record("x", "a"), "1", "2"), group(record("x", "b"), "3")])
    assert [s.reward for s in ga.samples] == [1.0, 1.0] and [s.reward for s in gb.samples] == [0.25]
    assert math.isnan(ga.samples[0].rewards["b"]) and math.isnan(gb.samples[0].rewards["a"])
    assert reward_set.max_total_for("a") == 1.0 and reward_set.max_total == 2.0


def test_reward_set_errors_name_the_field() -> None:
    with pytest.raises(ValueError, match="rewards.set=none leaves no reward"):
        build_reward_set("none", {})
    with pytest.raises(PluginError, match=r"rewards.custom=.*must accept \*\*kwargs"):
        build_reward_set("none", {}, "record_plugins:no_kwargs")
    with pytest.raises(PluginError, match="rewards.by_source.a"):
        build_reward_set("none", {}, None, None, {"a": "record_plugins:missing"})
    assert reward_style(trl_reward) == "columns"
    assert columns_problem(trl_reward, ["label", "meta"]) and "data_source" in columns_problem(trl_reward,
                                                                                                 ["label", "meta"])
    assert columns_problem(trl_reward, ["label", "meta", "data_source"]) is None


def test_exact_match_normalises_and_extracts_with_the_answer_pattern() -> None:
    batch = batch_from_records(["  The  CAT ", "answer: dog.", "answer: Dog", "x"],
                               [record("the cat"), record("dog"), record(["cat", "dog"]), record(3)])
    assert ExactMatch()(batch) == [1.0, 0.0, 0.0, 0.0]
    assert ExactMatch(r"answer:\s*(\w+)")(batch) == [0.0, 1.0, 1.0, 0.0]
    numbers = batch_from_records(["3"], [record(3)])
    assert ExactMatch()(numbers) == [1.0]
    with pytest.raises(ValueError, match="rewards.answer_pattern"):
        ExactMatch("(")
    reward_set = build_reward_set("exact_match", {}, answer_pattern=r"answer:\s*(\w+)")
    (g,) = score_groups(reward_set, [group(record("dog"), "answer: dog", "dog")])
    assert [s.reward for s in g.samples] == [1.0, 0.0]
    added = build_reward_set("none", {"exact_match": 2.0}, "record_plugins:async_reward", answer_pattern=r"is (\w+)")
    (g,) = score_groups(added, [group(record("dog"), "it is dog")])
    assert g.samples[0].rewards["exact_match"] == 1.0 and g.samples[0].reward == 2.5
    with pytest.raises(ValueError, match="rewards.answer_pattern=.*lacks"):
        build_reward_set("worklog", {}, answer_pattern="x")


def test_math_answer_reads_boxed_then_solution_against_a_numeric_label() -> None:
    assert boxed_text(r"so \boxed{\frac{1}{2}} or \boxed{42}") == "42"
    assert boxed_text(r"\boxed{{3}}") == "{3}" and boxed_text("none") is None
    completions = [r"it is \boxed{42}", "<SOLUTION>42</SOLUTION>", r"\boxed{41}", "42", r"\boxed{1,234}"]
    labels = [42, "42", 42, 42, "so #### 1234"]
    assert math_answer(batch_from_records(completions, [record(y) for y in labels])) == [1.0, 1.0, 0.0, 0.0, 1.0]
    assert math_answer(batch_from_records([r"\boxed{7}"], [record("seven")])) == [0.0]


def test_evaluation_set_measures_use_the_reward_maximum_as_threshold() -> None:
    reward_set = build_reward_set("none", {}, None, None, {"a": "record_plugins:only_a", "b": "record_plugins:only_b"})
    ga, gb = score_groups(reward_set, [group(record("x", "a"), "1", "2"), group(record("x", "b"), "3", "4")])
    result = summarise_set("dev", [ga, gb], 2, reward_set, None)
    # Source b's samples score 0.25 of a declared maximum 1.0 (its own function only): wrong.
    assert result.avg_at_k == 0.5 and result.pass_at == {1: 0.5, 2: 0.5} and result.reward_mean == 0.625
    assert result.stats() == {"eval/dev/reward_mean": 0.625, "eval/dev/avg@2": 0.5, "eval/dev/pass@1": 0.5,
                              "eval/dev/pass@2": 0.5}
    lowered = summarise_set("dev", [ga, gb], 2, reward_set, 0.2)
    assert lowered.avg_at_k == 1.0
    ga.samples[1].rewards["total"] = 0.0
    mixed = summarise_set("dev", [ga], 2, reward_set, None)
    assert mixed.pass_at == {1: 0.5, 2: 1.0} and mixed.avg_at_k == 0.5
    assert pass_points(8) == [1, 2, 4, 8] and pass_points(6) == [1, 2, 4, 6] and pass_points(1) == [1]


class SuiteEnv:
    stop = ("</run>",)

    def __init__(self) -> None:
        self.resets: list = []

    def reset(self, record):
        self.resets.append(record)
        return Episode(record.columns["meta"])

    def reply(self, turn, question):
        raise AssertionError("the trajectory's own environment answers")


class Episode:
    def __init__(self, meta) -> None:
        self.meta = meta

    def reply(self, turn, question):
        return f"meta={self.meta}"


def test_environment_reset_gives_each_trajectory_its_own_state() -> None:
    env = SuiteEnv()
    rec = record("x")
    episode = start_trajectory(env, rec)
    assert env.resets == [rec] and episode.reply("t", "q") == "meta={'n': 1}"

    class Stateless:
        stop = ("x",)

        def reply(self, turn, question):
            return None

    stateless = Stateless()
    assert start_trajectory(stateless, rec) is stateless
