"""Statistics stay on the device until read: the loss functions' `*_terms` variants return 0-d tensors, the
float variants read them in one transfer, and a trainer step reads all its micro-batches' statistics at once."""

from __future__ import annotations

import torch

from miles_lite.algo import LossConfig, mismatch_metrics, total_loss
from miles_lite.algo.device_stats import read_many, read_stats
from miles_lite.algo.losses import total_loss_terms
from miles_lite.algo.mismatch import mismatch_terms


def test_read_many_keeps_each_mapping_and_its_order() -> None:
    a = {"z": torch.tensor(1.5), "a": 2.0, "m": torch.tensor([3.0], dtype=torch.float64)}
    b = {"x": torch.tensor(-1.0, dtype=torch.bfloat16)}
    out = read_many([a, b, {}])
    assert out == [{"z": 1.5, "a": 2.0, "m": 3.0}, {"x": -1.0}, {}]
    assert list(out[0]) == ["z", "a", "m"]
    assert read_stats({"only": 4}) == {"only": 4.0}


def test_terms_are_tensors_and_read_to_the_float_results() -> None:
    gen = torch.Generator().manual_seed(0)
    logp = torch.rand(3, 5, generator=gen) * -2
    old = logp + 0.01 * torch.randn(3, 5, generator=gen)
    rollout = logp + 0.02 * torch.randn(3, 5, generator=gen)
    adv = torch.randn(3, 5, generator=gen)
    mask = torch.ones(3, 5)
    mask[2, 3:] = 0
    loss_t, terms = total_loss_terms(logp, old, adv, mask, LossConfig())
    assert terms and all(isinstance(v, torch.Tensor) and v.dim() == 0 for v in terms.values())
    loss_f, floats = total_loss(logp, old, adv, mask, LossConfig())
    assert torch.equal(loss_t, loss_f) and read_stats(terms) == floats
    weights, mismatch = mismatch_terms(old, rollout, mask, "token", "truncate", upper=2.0)
    assert weights.shape == mask.shape and all(isinstance(v, torch.Tensor) for v in mismatch.values())
    assert read_stats(mismatch) == mismatch_metrics(old, rollout, mask, "token", "truncate", upper=2.0)
