"""Train/inference mismatch: log-prob gap stats and importance weights (TIS / MIS)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from miles_lite.algo.mismatch import importance_weights, logp_diff_stats, mismatch_metrics

F64 = torch.float64
LEVELS = ["token", "sequence_product", "sequence_geomean"]
MODES = ["truncate", "mask"]


def _ragged_mask(lengths: list[int], width: int) -> torch.Tensor:
    return (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).to(F64)


def test_logp_diff_stats_hand_computed() -> None:
    train = torch.tensor([[-1.0, -2.0, -5.0], [-0.5, -math.inf, 0.0]], dtype=F64)
    rollout = torch.tensor([[-1.1, -1.7, 0.0], [-0.5, 0.0, 3.0]], dtype=F64)
    mask = _ragged_mask([2, 1], 3)
    stats = logp_diff_stats(train, rollout, mask)
    # Masked differences: 0.1, -0.3, 0.0.
    assert stats["logp_diff_mean"] == pytest.approx(-0.2 / 3)
    assert stats["logp_abs_diff_mean"] == pytest.approx(0.4 / 3)
    assert stats["logp_abs_diff_max"] == pytest.approx(0.3)
    k3 = [math.expm1(d) - d for d in (0.1, -0.3, 0.0)]
    assert stats["kl_k3"] == pytest.approx(sum(k3) / 3)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("mode", MODES)
def test_no_mismatch_gives_unit_weights(level: str, mode: str) -> None:
    logp = -torch.rand(3, 5, dtype=F64) * 4
    mask = _ragged_mask([5, 2, 0], 5)
    res = importance_weights(logp, logp.clone(), mask, level, mode, upper=1.0 if mode == "truncate" else 2.0)
    assert torch.equal(res.weights, mask)  # exactly 1 on every counted token, 0 on padding
    assert res.stats["masked_fraction"] == 0.0 and res.stats["clipped_fraction"] == 0.0
    assert res.stats["raw_ratio_min"] == res.stats["raw_ratio_max"] == res.stats["applied_mean"] == 1.0


def test_geomean_does_not_grow_with_length_but_product_does() -> None:
    # A constant per-token gap of 0.05 nats on a 10-token and a 200-token response.
    mask = _ragged_mask([10, 200], 200)
    rollout = torch.full((2, 200), -1.0, dtype=F64)
    train = rollout + 0.05
    product = importance_weights(train, rollout, mask, "sequence_product", "mask", upper=2.0)
    geomean = importance_weights(train, rollout, mask, "sequence_geomean", "mask", upper=2.0)
    # Product: exp(0.5) = 1.65 keeps the short one, exp(10) rejects the long one.
    assert product.weights[0, :10].allclose(torch.full((10,), math.exp(0.5), dtype=F64))
    assert torch.equal(product.weights[1], torch.zeros(200, dtype=F64))
    assert product.stats["masked_fraction"] == pytest.approx(200 / 210)
    # Geometric mean: exp(0.05) for both lengths, nothing rejected.
    torch.testing.assert_close(geomean.weights, mask * math.exp(0.05))
    assert geomean.stats["masked_fraction"] == 0.0


def test_token_level_truncate_and_mask() -> None:
    train = torch.tensor([[math.log(3.0), math.log(1.5), math.log(0.25), 0.0]], dtype=F64)
    rollout = torch.zeros(1, 4, dtype=F64)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]], dtype=F64)
    tis = importance_weights(train, rollout, mask, "token", "truncate", upper=2.0)
    torch.testing.assert_close(tis.weights, torch.tensor([[2.0, 1.5, 0.25, 0.0]], dtype=F64))
    assert tis.stats["clipped_fraction"] == pytest.approx(1 / 3) and tis.stats["masked_fraction"] == 0.0
    assert tis.stats["raw_ratio_max"] == pytest.approx(3.0)
    assert tis.stats["raw_ratio_min"] == pytest.approx(0.25)
    mis = importance_weights(train, rollout, mask, "token", "mask", upper=2.0)
    # Kept tokens keep their raw ratio; 3.0 > 2 and 0.25 < 1/2 are rejected.
    torch.testing.assert_close(mis.weights, torch.tensor([[0.0, 1.5, 0.0, 0.0]], dtype=F64))
    assert mis.stats["masked_fraction"] == pytest.approx(2 / 3) and mis.stats["clipped_fraction"] == 0.0
    assert mis.stats["applied_mean"] == pytest.approx(0.5)
    lower = importance_weights(train, rollout, mask, "token", "mask", upper=2.0, lower=0.2)
    torch.testing.assert_close(lower.weights, torch.tensor([[0.0, 1.5, 0.25, 0.0]], dtype=F64))


def test_sequence_product_is_overflow_safe() -> None:
    mask = torch.ones(1, 4000, dtype=torch.float32)
    train = torch.zeros(1, 4000)
    rollout = torch.full((1, 4000), -1.0)
    res = importance_weights(train, rollout, mask, "sequence_product", "truncate", upper=2.0)
    assert torch.isfinite(res.weights).all() and math.isfinite(res.stats["raw_ratio_max"])
    assert torch.equal(res.weights, torch.full((1, 4000), 2.0))


def test_weights_are_detached_and_inputs_validated() -> None:
    train = torch.zeros(2, 3, dtype=F64, requires_grad=True)
    res = importance_weights(train, torch.zeros(2, 3, dtype=F64), torch.ones(2, 3), "token", "truncate")
    assert not res.weights.requires_grad
    with pytest.raises(ValueError, match="must all be"):
        importance_weights(train, torch.zeros(2, 4), torch.ones(2, 3), "token", "mask")
    with pytest.raises(ValueError, match="level='seq' is not supported"):
        importance_weights(train, train, torch.ones(2, 3), "seq", "mask")
    with pytest.raises(ValueError, match="upper must be >= 1"):
        importance_weights(train, train, torch.ones(2, 3), "token", "mask", upper=0.5)
    with pytest.raises(ValueError, match="only used by mode='mask'"):
        importance_weights(train, train, torch.ones(2, 3), "token", "truncate", lower=0.5)


def test_mismatch_metrics_keys() -> None:
    train = torch.tensor([[-1.0, -2.0]], dtype=F64)
    rollout = torch.tensor([[-1.2, -2.0]], dtype=F64)
    out = mismatch_metrics(train, rollout, torch.ones(1, 2), "token", "truncate", upper=1.1)
    assert out["mismatch/logp_diff_mean"] == pytest.approx(0.1)
    assert out["mismatch/is_raw_mean"] == pytest.approx((math.exp(0.2) + 1) / 2)
    assert out["mismatch/is_applied_mean"] == pytest.approx((1.1 + 1) / 2)
    assert out["mismatch/clipped_fraction"] == pytest.approx(0.5)
    assert {"mismatch/masked_fraction", "mismatch/is_raw_max", "mismatch/kl_k3"} <= out.keys()
    assert all(k.startswith("mismatch/") for k in out)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.floats(-3, 3, allow_nan=False), min_size=12, max_size=12),
    st.sampled_from(LEVELS),
    st.floats(1.0, 5.0),
)
def test_weight_bounds_property(diffs: list[float], level: str, upper: float) -> None:
    rollout = -torch.ones(3, 4, dtype=F64)
    train = rollout + torch.tensor(diffs, dtype=F64).view(3, 4)
    mask = _ragged_mask([4, 1, 3], 4)
    tis = importance_weights(train, rollout, mask, level, "truncate", upper=upper)
    on = mask > 0
    assert torch.all(tis.weights[on] <= upper) and torch.all(tis.weights[on] > 0)
    mis = importance_weights(train, rollout, mask, level, "mask", upper=upper)
    kept = mis.weights[on][mis.weights[on] > 0]
    assert torch.all(kept <= upper * (1 + 1e-12)) and torch.all(kept >= (1 / upper) * (1 - 1e-12))
    assert torch.all(mis.weights[~on] == 0) and torch.all(tis.weights[~on] == 0)
    assert 0.0 <= mis.stats["masked_fraction"] <= 1.0
