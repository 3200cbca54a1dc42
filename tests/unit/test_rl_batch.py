"""From groups to the trainer's batch: staleness filter, advantages, distillation batch, stats."""

from __future__ import annotations

import pytest

from miles_lite.config.schema import AlgoConfig
from miles_lite.run.rl_batch import build_train_batch, distill_batch, drop_stale, oldest_version, reward_stats
from miles_lite.types import Group, Sample


def _sample(version: str, reward: float = 0.0, response: tuple[int, ...] = (7, 8)) -> Sample:
    return Sample(prompt_index=0, prompt_ids=[1, 2, 3], response_ids=list(response),
                  rollout_logprobs=[-0.5] * len(response), weight_version=version, rewards={"total": reward})


def _group(index: int, versions: list[str], rewards: list[float] | None = None) -> Group:
    rewards = rewards or [float(i) for i in range(len(versions))]
    return Group(prompt_index=index, prompt_text="p", question="q", answer=1.0, steps=(),
                 samples=[_sample(v, r) for v, r in zip(versions, rewards, strict=True)])


@pytest.mark.parametrize(("version", "oldest"), [("3", 3), ("3+4", 3), ("5+4", 4), ("", None), ("default", None),
                                                 ("2+default", None)])
def test_oldest_version_reads_push_numbers(version: str, oldest: int | None):
    assert oldest_version(_sample(version)) == oldest


def test_drop_stale_judges_each_group_by_its_oldest_sample():
    groups = [_group(0, ["5", "5"]), _group(1, ["4+5", "5"]), _group(2, ["3+4", "5"]), _group(3, ["5", "default"])]
    kept, stats = drop_stale(groups, current_version=5, max_staleness=1)
    assert [g.prompt_index for g in kept] == [0, 1]
    assert stats["rollout/stale_dropped"] == 2.0
    assert stats["rollout/mixed_version_samples"] == 2.0
    assert stats["rollout/staleness_max"] == 2.0
    # Lags of the samples with a known version: 0, 0, 1, 0, 2, 0, 0.
    assert stats["rollout/staleness_mean"] == pytest.approx(3 / 7)
    assert [stats[f"rollout/staleness_samples/{lag}"] for lag in (0, 1, 2)] == [5.0, 1.0, 1.0]
    assert "rollout/staleness_samples/3" not in stats


def test_drop_stale_with_zero_staleness_keeps_only_on_policy_groups():
    kept, stats = drop_stale([_group(0, ["7", "7"]), _group(1, ["6+7", "7"])], current_version=7, max_staleness=0)
    assert [g.prompt_index for g in kept] == [0] and stats["rollout/stale_dropped"] == 1.0
    with pytest.raises(ValueError, match="rollout.max_staleness"):
        drop_stale([], 1, -1)


def test_build_train_batch_has_one_sequence_per_completion_and_counts_zero_signal():
    groups = [_group(0, ["1", "1"], [1.0, 0.0]), _group(1, ["1", "1"], [2.0, 2.0])]
    batch, stats = build_train_batch(groups, AlgoConfig())
    assert batch is not None and batch.num_sequences == 4
    assert batch.tokens[0] == [1, 2, 3, 7, 8] and batch.prompt_lengths == [3] * 4
    assert batch.advantages[0] > 0 > batch.advantages[1] and batch.advantages[2:] == [0.0, 0.0]
    assert stats["algo/zero_signal_groups"] == 1.0 and stats["algo/zero_signal_share"] == 0.5
    dropped, stats = build_train_batch(groups, AlgoConfig(drop_zero_signal=True))
    assert dropped is not None and dropped.num_sequences == 2 and stats["algo/trained_sequences"] == 2.0


def test_reinforce_pp_config_whitens_the_train_batch_over_all_groups():
    groups = [_group(0, ["1", "1"], [1.0, 0.0]), _group(1, ["1", "1"], [2.0, 2.0])]
    batch, _ = build_train_batch(groups, AlgoConfig(advantage_estimator="reinforce_pp"))
    # Batch mean 1.25, population std sqrt(0.6875): the all-2 group is above the mean, so it is trained up.
    std = 0.6875 ** 0.5
    assert batch is not None
    assert batch.advantages == pytest.approx([-0.25 / std, -1.25 / std, 0.75 / std, 0.75 / std], rel=1e-5)


def test_build_train_batch_of_nothing_and_of_unequal_groups():
    batch, stats = build_train_batch([], AlgoConfig())
    assert batch is None and stats["algo/groups"] == 0.0
    # Groups an agent's dropped sample left short train on the ragged groups: a group of one has no baseline
    # (zero-signal), an empty group contributes nothing.
    short, single, empty = _group(0, ["1", "2"]), _group(1, ["1"]), _group(2, [])
    short.samples[0].rewards, short.samples[1].rewards = {"total": 1.0}, {"total": 0.0}
    batch, stats = build_train_batch([short, single, empty], AlgoConfig(drop_zero_signal=True))
    assert stats["algo/groups"] == 3.0 and stats["algo/zero_signal_groups"] == 1.0
    assert batch is not None and batch.num_sequences == 2
    assert batch.advantages[0] > 0 > batch.advantages[1]


def test_distill_batch_has_zero_advantages_and_skips_empty_completions():
    group = _group(0, ["1", "1"])
    group.samples.append(_sample("1", response=()))
    batch = distill_batch([group])
    assert batch is not None and batch.num_sequences == 2
    assert batch.advantages == [0.0, 0.0] and batch.rollout_logprobs == [[-0.5, -0.5]] * 2
    assert batch.teacher_logprobs is None
    empty = _group(1, ["1"])
    empty.samples = [_sample("1", response=())]
    assert distill_batch([empty]) is None


def test_reward_stats_cover_every_sample():
    stats = reward_stats([_group(0, ["1", "1"], [1.0, 3.0])])
    assert stats["reward/mean"] == 2.0 and stats["reward/std"] == 1.0
    assert stats["rollout/response_length_mean"] == 2.0
