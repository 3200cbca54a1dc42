"""Group advantage estimators: hand-computed values, zero-signal groups, validation."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from miles_lite.algo.advantages import (
    GROUP_ESTIMATORS,
    compute_advantages,
    drop_zero_signal,
    expand_to_tokens,
)

GROUP_BASELINES = sorted(e.value for e in GROUP_ESTIMATORS)


@pytest.mark.parametrize("estimator", GROUP_BASELINES)
@pytest.mark.parametrize("value", [0.0, 1.0, 0.1])
def test_all_equal_group_has_exactly_zero_advantages(estimator: str, value: float) -> None:
    # Group 0 is 0/8 (or 8/8) right; group 1 has signal so the batch whitening is non-trivial.
    rewards = torch.tensor([value] * 8 + [1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0])
    res = compute_advantages(rewards, 8, estimator)
    assert torch.equal(res.advantages[:8], torch.zeros(8))
    assert res.advantages[8:].abs().sum() > 0
    assert res.zero_signal_mask.tolist() == [True, False]
    assert res.zero_signal_share == 0.5
    assert res.keep_mask.tolist() == [False] * 8 + [True] * 8


def test_grpo_hand_computed() -> None:
    # Group [1, 0, 0, 0]: mean 0.25, unbiased std sqrt(0.75 / 3) = 0.5 -> [1.5, -0.5, -0.5, -0.5].
    # Group [1, 1, 0, 0]: mean 0.5, unbiased std sqrt(1 / 3) -> +-0.5 * sqrt(3).
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0], dtype=torch.float64)
    res = compute_advantages(rewards, 4, "grpo", eps=0.0)
    h = 0.5 * math.sqrt(3.0)
    expected = torch.tensor([1.5, -0.5, -0.5, -0.5, h, h, -h, -h], dtype=torch.float64)
    torch.testing.assert_close(res.advantages, expected)
    assert res.zero_signal_share == 0.0


def test_grpo_eps_only_slightly_shrinks() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    adv = compute_advantages(rewards, 4, "grpo", eps=1e-6).advantages
    centered = torch.tensor([0.75, -0.25, -0.25, -0.25], dtype=torch.float64)
    torch.testing.assert_close(adv, centered / (0.5 + 1e-6))


def test_dr_grpo_is_grpo_without_std() -> None:
    rewards = torch.tensor([2.0, 0.0, 1.0, 1.0, 5.0, 3.0])
    dr = compute_advantages(rewards, 3, "dr_grpo").advantages
    torch.testing.assert_close(dr, torch.tensor([1.0, -1.0, 0.0, -2.0, 2.0, 0.0]))
    no_std = compute_advantages(rewards, 3, "grpo", std_normalize=False).advantages
    torch.testing.assert_close(dr, no_std)


def test_rloo_formula() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 3.0, 1.0, 2.0, 0.0], dtype=torch.float64)
    adv = compute_advantages(rewards, 4, "rloo").advantages
    r = rewards.view(2, 4)
    expected = torch.stack(
        [torch.stack([r[g, i] - (r[g].sum() - r[g, i]) / 3 for i in range(4)]) for g in range(2)]
    ).view(-1)
    torch.testing.assert_close(adv, expected)
    # Hand check of the first group: 1 - 0, 0 - 1/3.
    torch.testing.assert_close(adv[:2], torch.tensor([1.0, -1.0 / 3], dtype=torch.float64))


def test_reinforce_pp_whitens_only_signal_groups() -> None:
    rewards = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 4.0, 0.0, 0.0, 2.0], dtype=torch.float64)
    adv = compute_advantages(rewards, 4, "reinforce_pp_baseline", eps=0.0).advantages
    assert torch.equal(adv[:4], torch.zeros(4, dtype=torch.float64))
    signal = adv[4:]
    torch.testing.assert_close(signal.mean(), torch.tensor(0.0, dtype=torch.float64))
    torch.testing.assert_close(signal.std(correction=0), torch.tensor(1.0, dtype=torch.float64))
    centered = torch.tensor([-0.25, -0.25, 0.75, -0.25, 2.5, -1.5, -1.5, 0.5], dtype=torch.float64)
    torch.testing.assert_close(signal, centered / centered.std(correction=0))


def test_reinforce_pp_all_zero_signal_batch() -> None:
    res = compute_advantages(torch.ones(8), 4, "reinforce_pp_baseline")
    assert torch.equal(res.advantages, torch.zeros(8))
    assert res.zero_signal_share == 1.0


def test_reinforce_pp_whitens_over_the_batch_hand_computed() -> None:
    # Batch mean 3/8, population std sqrt(3/8 * 5/8): a right answer gets (5/8) / std = sqrt(5/3),
    # a wrong one -(3/8) / std = -sqrt(3/5), whichever group it is in (no per-prompt baseline).
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    adv = compute_advantages(rewards, 4, "reinforce_pp", eps=0.0).advantages
    up, down = math.sqrt(5 / 3), -math.sqrt(3 / 5)
    torch.testing.assert_close(adv, torch.tensor([up, up, down, down, up, down, down, down], dtype=torch.float64))
    # The group baseline would give the two right answers of group 0 less than the one of group 1.
    grpo = compute_advantages(rewards, 4, "grpo", eps=0.0).advantages
    assert grpo[0] < grpo[4] and adv[0] == adv[4]


def test_reinforce_pp_keeps_zero_signal_groups_and_accepts_groups_of_one() -> None:
    res = compute_advantages(torch.tensor([1.0] * 4 + [0.0] * 4), 4, "reinforce_pp", eps=0.0)
    torch.testing.assert_close(res.advantages, torch.tensor([1.0] * 4 + [-1.0] * 4))
    assert res.zero_signal_share == 1.0  # still reported, and dropped with algo.drop_zero_signal
    single = compute_advantages(torch.tensor([2.0, 0.0, 1.0], dtype=torch.float64), 1, "reinforce_pp", eps=0.0)
    s = math.sqrt(1.5)  # (r - 1) / sqrt(2/3)
    torch.testing.assert_close(single.advantages, torch.tensor([s, -s, 0.0], dtype=torch.float64))
    assert single.zero_signal_share == 0.0
    flat = compute_advantages(torch.ones(6), 2, "reinforce_pp").advantages
    assert torch.equal(flat, torch.zeros(6))


def test_near_equal_rewards_within_tolerance_are_zero_signal() -> None:
    rewards = torch.tensor([0.5, 0.5 + 1e-9, 0.5, 0.5], dtype=torch.float64)
    res = compute_advantages(rewards, 4, "grpo")
    assert res.zero_signal_mask.tolist() == [True]
    assert torch.equal(res.advantages, torch.zeros(4, dtype=torch.float64))


def test_integer_rewards_are_accepted() -> None:
    res = compute_advantages(torch.tensor([1, 0, 0, 0]), 4, "rloo")
    assert res.advantages.is_floating_point()
    torch.testing.assert_close(res.advantages[0], torch.tensor(1.0))


@pytest.mark.parametrize(
    ("rewards", "group_size", "estimator", "match"),
    [
        (torch.zeros(10), 4, "grpo", "not divisible by group_size"),
        (torch.zeros(4), 1, "grpo", "group_size must be an int >= 2"),
        (torch.zeros(4), 1, "rloo", "group_size must be an int >= 2"),
        (torch.zeros(2, 4), 4, "grpo", "1-D tensor"),
        (torch.zeros(0), 4, "grpo", "empty"),
        (torch.tensor([0.0, float("nan")]), 2, "grpo", "NaN"),
        (torch.zeros(4), 2, "ppo", "estimator='ppo' is not supported"),
    ],
)
def test_bad_inputs_raise(rewards: torch.Tensor, group_size: int, estimator: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        compute_advantages(rewards, group_size, estimator)


def test_drop_zero_signal_and_expand() -> None:
    keep = drop_zero_signal(torch.tensor([True, False]), 3)
    assert keep.tolist() == [False, False, False, True, True, True]
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    out = expand_to_tokens(torch.tensor([2.0, -1.0]), mask)
    assert torch.equal(out, torch.tensor([[2.0, 2.0, 0.0], [-1.0, 0.0, 0.0]]))
    with pytest.raises(ValueError, match="same B"):
        expand_to_tokens(torch.tensor([1.0]), mask)


group_rewards = st.integers(min_value=1, max_value=4).flatmap(
    lambda n: st.integers(min_value=2, max_value=8).flatmap(
        lambda g: st.tuples(
            st.just(g),
            st.lists(st.sampled_from([0.0, 0.5, 1.0, 2.0]), min_size=n * g, max_size=n * g),
        )
    )
)


@settings(max_examples=60, deadline=None)
@given(group_rewards, st.sampled_from(["grpo", "dr_grpo", "rloo"]))
def test_group_advantages_sum_to_zero_and_ignore_shift(case: tuple[int, list[float]], estimator: str) -> None:
    g, values = case
    rewards = torch.tensor(values, dtype=torch.float64)
    adv = compute_advantages(rewards, g, estimator).advantages
    torch.testing.assert_close(adv.view(-1, g).sum(dim=1), torch.zeros(len(values) // g, dtype=torch.float64))
    shifted = compute_advantages(rewards + 3.0, g, estimator).advantages
    torch.testing.assert_close(adv, shifted)
    # Better-than-group completions get positive advantage, worse ones negative.
    r = rewards.view(-1, g)
    sign = torch.sign(r - r.mean(dim=1, keepdim=True)).view(-1)
    assert torch.all(torch.sign(adv) == sign)
