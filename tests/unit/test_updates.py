"""Several updates per rollout batch: mini-batch plan, the old policy in the micro-batch loss, stats."""

from __future__ import annotations

import math

import pytest
import torch

from miles_lite.config.schema import AlgoConfig
from miles_lite.trainer.packing import pack
from miles_lite.trainer.rl_loss import rl_micro_loss
from miles_lite.trainer.updates import combine_update_stats, minibatch_plan
from miles_lite.types import TrainBatch


def test_minibatch_plan_covers_every_sequence_once_per_epoch() -> None:
    plan = minibatch_plan(10, updates=3, epochs=2, seed=7)
    assert [len(p) for p in plan] == [4, 3, 3, 4, 3, 3]
    assert sorted(i for p in plan[:3] for i in p) == list(range(10))
    assert sorted(i for p in plan[3:] for i in p) == list(range(10))
    assert plan[:3] != plan[3:]  # each epoch reshuffles
    assert plan == minibatch_plan(10, updates=3, epochs=2, seed=7)  # the same on every rank
    assert minibatch_plan(5, 1, 1, seed=3) == [[0, 1, 2, 3, 4]]
    assert len(minibatch_plan(2, updates=4, epochs=1, seed=0)) == 2  # never an empty mini-batch
    with pytest.raises(ValueError, match="updates_per_rollout"):
        minibatch_plan(4, 0, 1, seed=0)


def _batch(old: list[list[float]] | None) -> TrainBatch:
    # Two sequences, prompt of 1 token, responses of 2 and 1 tokens; advantages +1 and -1.
    return TrainBatch(tokens=[[5, 6, 7], [5, 8]], prompt_lengths=[1, 1], rollout_logprobs=[[-1.0, -1.0], [-1.0]],
                      advantages=[1.0, -1.0], old_logprobs=old)


def test_micro_loss_takes_the_ratio_against_the_old_logprobs_hand_computed() -> None:
    algo = AlgoConfig(is_level="none", clip_low=0.2, clip_high=0.28)
    mb = pack([[5, 6, 7], [5, 8]], [1, 1], [0, 1])
    # Current log-probs: -1 on every token. Old: ratios 1.5 (A=+1, clipped at 1.28), 1.1 (A=+1, free)
    # and 0.5 (A=-1, clipped at 0.8). Token-mean loss: (-1.28 - 1.1 + 0.8) / 3.
    logp = torch.full((3,), -1.0, dtype=torch.float32, requires_grad=True)
    old = [[-1.0 - math.log(1.5), -1.0 - math.log(1.1)], [-1.0 - math.log(0.5)]]
    loss, stats = rl_micro_loss(logp, None, mb, _batch(old), algo, None, None)
    loss.backward()
    assert loss.item() == pytest.approx((-1.28 - 1.1 + 0.8) / 3, rel=1e-6)
    assert stats["policy/clip_frac_high"] == pytest.approx(1 / 3)
    assert stats["policy/clip_frac_low"] == pytest.approx(1 / 3)
    assert stats["policy/ratio_max"] == pytest.approx(1.5, rel=1e-6)
    assert stats["policy/ratio_min"] == pytest.approx(0.5, rel=1e-6)
    # Clipped tokens carry no gradient; the free one d/dlogp(-A r / 3) = -1.1 / 3.
    torch.testing.assert_close(logp.grad, torch.tensor([0.0, -1.1 / 3, 0.0]))
    # Without old log-probs the trainer itself is the old policy: ratio 1, nothing clipped.
    logp2 = torch.full((3,), -1.0, requires_grad=True)
    loss2, stats2 = rl_micro_loss(logp2, None, mb, _batch(None), algo, None, None)
    assert stats2["policy/clip_frac_high"] == stats2["policy/clip_frac_low"] == 0.0
    assert loss2.item() == pytest.approx((-1 - 1 + 1) / 3)


def test_combined_stats_average_updates_and_count_them() -> None:
    batch = _batch(None)
    base = {"lr": 1e-3, "nonfinite_total": 0.0, "tokens": 5.0, "skipped": 0.0}
    per_update = [
        {**base, "policy/clip_frac_low": 0.0, "policy/clip_frac_high": 0.0, "policy/ratio_max": 1.0,
         "policy/ratio_min": 1.0, "grad_norm": 2.0, "loss/total": 1.0},
        {**base, "policy/clip_frac_low": 0.1, "policy/clip_frac_high": 0.3, "policy/ratio_max": 1.6,
         "policy/ratio_min": 0.7, "grad_norm": float("nan"), "loss/total": 3.0, "skipped": 1.0, "lr": 2e-3},
    ]
    stats = combine_update_stats(per_update, batch, seconds=2.0)
    assert stats["policy/updates"] == 2.0 and stats["skipped"] == 1.0 and stats["lr"] == 2e-3
    assert stats["policy/clip_frac"] == pytest.approx(0.2) and stats["policy/ratio_spread"] == pytest.approx(0.9)
    assert stats["grad_norm"] == 2.0 and stats["loss/total"] == 2.0
    assert stats["tokens"] == 5.0 and stats["tokens_per_s"] == 5.0
