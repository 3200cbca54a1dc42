"""Train/inference mismatch: how far the rollout engine's log-probs are from the trainer's.

The rollout engine (SGLang) and the trainer (Megatron) compute log-probs of the same sampled tokens
under the same weights with different kernels, precisions and parallel layouts, so they disagree.
The data is then off-policy with respect to the trainer, and the gap can silently grow until
training collapses. This module measures the gap and builds importance-sampling (IS) weights that
correct for it:

* truncated IS (TIS): ``w = min(ratio, upper)``, applied to every token;
* masked IS (MIS): ratios outside ``[lower, upper]`` get weight 0 (the token or whole sequence is
  rejected); the others keep their raw ratio.

Inputs are padded ``[B, T]`` log-probs (nats) of the sampled tokens with ``mask [B, T]`` (1.0 on
counted response tokens). Values outside the mask are ignored and may hold garbage.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import torch
from torch import Tensor

from miles_lite.algo.choices import parse_choice
from miles_lite.algo.device_stats import DeviceStats, read_stats

# Cap on a log-weight before exp: exp(20) ~ 4.9e8 is far beyond any threshold, and a sequence
# product over thousands of tokens would otherwise overflow to inf even in float32.
_LOG_WEIGHT_CLAMP = 20.0


class ISLevel(StrEnum):
    """Granularity of the importance ratio."""

    TOKEN = "token"
    SEQUENCE_PRODUCT = "sequence_product"
    SEQUENCE_GEOMEAN = "sequence_geomean"


class ISMode(StrEnum):
    """How out-of-range ratios are handled."""

    TRUNCATE = "truncate"
    MASK = "mask"


@dataclass(frozen=True)
class ISResult:
    """Output of :func:`importance_weights`.

    Attributes:
        weights: ``[B, T]`` detached weights to multiply the per-token loss with; 0 outside the mask.
        stats: floats ``raw_ratio_mean``, ``raw_ratio_max``, ``raw_ratio_min``, ``applied_mean``,
            ``masked_fraction``, ``clipped_fraction``, all token-weighted over masked tokens (a
            sequence-level ratio counts once per token of its sequence).
    """

    weights: Tensor
    stats: dict[str, float]



def _masked_diff(train_logp: Tensor, rollout_logp: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Detached ``train - rollout`` (0 outside the mask) and the bool mask, after shape checks."""
    if mask.dim() != 2 or train_logp.shape != mask.shape or rollout_logp.shape != mask.shape:
        raise ValueError(
            f"train_logp, rollout_logp and mask must all be [B, T]; got {tuple(train_logp.shape)}, "
            f"{tuple(rollout_logp.shape)}, {tuple(mask.shape)} (pad both log-prob tensors like the mask)"
        )
    keep = mask > 0
    diff = torch.where(keep, train_logp.detach() - rollout_logp.detach(), torch.zeros_like(train_logp))
    return diff, keep


def _mean_max_min(values: Tensor, keep: Tensor) -> list[Tensor]:
    """Masked mean, max and min as 0-d tensors (all 0 for an empty mask)."""
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    inf = torch.full((), float("inf"), dtype=values.dtype, device=values.device)
    count = keep.sum().to(values.dtype)
    mean = torch.where(keep, values, zero).sum() / count.clamp_min(1.0)
    has = count > 0
    vmax = torch.where(has, torch.where(keep, values, -inf).amax(), zero)
    vmin = torch.where(has, torch.where(keep, values, inf).amin(), zero)
    return [mean, vmax, vmin]


def logp_diff_stats(train_logp: Tensor, rollout_logp: Tensor, mask: Tensor) -> dict[str, float]:
    """:func:`logp_diff_terms` read as floats (one host sync)."""
    return read_stats(logp_diff_terms(train_logp, rollout_logp, mask))


def logp_diff_terms(train_logp: Tensor, rollout_logp: Tensor, mask: Tensor) -> DeviceStats:
    """Summary of ``train_logp - rollout_logp`` over masked tokens (nats per token), as 0-d tensors.

    Returns:
        ``logp_diff_mean`` (signed: > 0 means the trainer finds the tokens more likely than the
        engine did), ``logp_abs_diff_mean``, ``logp_abs_diff_max``, and ``kl_k3``: the mean k3
        estimate of KL(rollout || train) from the rollout's samples, ``exp(d) - d - 1`` with
        ``d = train - rollout``. All 0 for an empty mask.
    """
    diff, keep = _masked_diff(train_logp, rollout_logp, mask)
    d = diff.clamp(-_LOG_WEIGHT_CLAMP, _LOG_WEIGHT_CLAMP)
    signed_mean = _mean_max_min(diff, keep)[0]
    abs_mean, abs_max, _ = _mean_max_min(diff.abs(), keep)
    k3 = _mean_max_min(torch.expm1(d) - d, keep)[0]
    names = ["logp_diff_mean", "logp_abs_diff_mean", "logp_abs_diff_max", "kl_k3"]
    return dict(zip(names, [signed_mean, abs_mean, abs_max, k3], strict=True))


def importance_weights(*args: Any, **kwargs: Any) -> ISResult:
    """:func:`importance_terms` (same arguments) as an :class:`ISResult` (statistics read as floats, one host
    sync)."""
    weights, stats = importance_terms(*args, **kwargs)
    return ISResult(weights=weights, stats=read_stats(stats))


def importance_terms(
    train_logp: Tensor,
    rollout_logp: Tensor,
    mask: Tensor,
    level: ISLevel | str = ISLevel.SEQUENCE_GEOMEAN,
    mode: ISMode | str = ISMode.MASK,
    *,
    upper: float = 2.0,
    lower: float | None = None,
) -> tuple[Tensor, DeviceStats]:
    """Importance weights correcting rollout-engine data towards the trainer's distribution.

    With ``d_t = train_logp_t - rollout_logp_t`` on masked tokens, the raw ratio is:

    * ``token``: ``exp(d_t)`` per token.
    * ``sequence_product``: ``exp(sum_t d_t)``, the exact sequence likelihood ratio, repeated on the
      sequence's tokens. It grows exponentially with length for a constant per-token gap, so with a
      fixed threshold long responses get truncated/rejected for a tiny per-token mismatch. The
      exponent is clamped to ``[-20, 20]`` to avoid overflow.
    * ``sequence_geomean``: ``exp(mean_t d_t)``, the per-token geometric mean. It does not grow with
      length, so use it (not the product) for sequence-level rejection thresholds.

    Modes:

    * ``truncate`` (TIS): ``w = min(ratio, upper)``; ``lower`` must be None.
    * ``mask`` (MIS): ``w = ratio`` where ``lower <= ratio <= upper`` and 0 elsewhere;
      ``lower`` defaults to ``1 / upper``. Kept tokens keep their raw (un-truncated) ratio, which is
      already bounded by ``upper``, so the correction stays unbiased on the accepted region while
      rejected tokens/sequences contribute nothing.

    Args:
        train_logp: ``[B, T]`` trainer log-probs of the sampled tokens (nats; detached here).
        rollout_logp: ``[B, T]`` rollout-engine log-probs of the same tokens (nats).
        mask: ``[B, T]`` 1.0 on counted response tokens.
        level / mode: see above (enum or string value).
        upper: ratio threshold, >= 1 so that a perfect match (ratio 1) is never touched.
        lower: mask-mode lower threshold in ``(0, 1]``; default ``1 / upper``.

    Returns:
        ``(weights, stats)``: the applied weights ``[B, T]`` and the statistics of :class:`ISResult` as 0-d
        tensors. With identical log-probs every masked weight is exactly 1 and nothing is clipped or masked.
    """
    lvl = parse_choice(ISLevel, level, "level")
    md = parse_choice(ISMode, mode, "mode")
    if upper < 1.0:
        raise ValueError(f"upper must be >= 1 (a ratio of 1 means no mismatch and must be kept); got {upper}")
    if md is ISMode.TRUNCATE and lower is not None:
        raise ValueError("lower is only used by mode='mask'; truncation (TIS) caps from above only")
    lo = 1.0 / upper if lower is None else lower
    if not 0.0 < lo <= 1.0:
        raise ValueError(f"lower must be in (0, 1]; got {lower}")

    diff, keep = _masked_diff(train_logp, rollout_logp, mask)
    if lvl is ISLevel.TOKEN:
        log_w = diff
    else:
        seq_sum = diff.sum(dim=-1, keepdim=True)  # [B, 1]
        if lvl is ISLevel.SEQUENCE_GEOMEAN:
            seq_sum = seq_sum / keep.sum(dim=-1, keepdim=True).clamp_min(1).to(diff.dtype)
        log_w = seq_sum.expand_as(diff)
    zeros = torch.zeros_like(diff)
    raw = torch.where(keep, torch.exp(log_w.clamp(-_LOG_WEIGHT_CLAMP, _LOG_WEIGHT_CLAMP)), zeros)

    if md is ISMode.TRUNCATE:
        clipped = keep & (raw > upper)
        rejected = torch.zeros_like(keep)
        applied = torch.where(clipped, torch.full_like(raw, upper), raw)
    else:
        rejected = keep & ((raw < lo) | (raw > upper))
        clipped = torch.zeros_like(keep)
        applied = torch.where(rejected, zeros, raw)

    values = [
        *_mean_max_min(raw, keep),
        _mean_max_min(applied, keep)[0],
        _mean_max_min(rejected.to(raw.dtype), keep)[0],
        _mean_max_min(clipped.to(raw.dtype), keep)[0],
    ]
    names = ["raw_ratio_mean", "raw_ratio_max", "raw_ratio_min", "applied_mean", "masked_fraction",
             "clipped_fraction"]
    return applied, dict(zip(names, values, strict=True))


def mismatch_metrics(*args: Any, **kwargs: Any) -> dict[str, float]:
    """The statistics of :func:`mismatch_terms` (same arguments) read as floats (one host sync): the log-prob gap
    and IS statistics in one dict, keyed for logging.

    Keys (with the default prefix): ``mismatch/logp_diff_mean``, ``mismatch/logp_abs_diff_mean``,
    ``mismatch/logp_abs_diff_max``, ``mismatch/kl_k3``, ``mismatch/is_raw_mean``,
    ``mismatch/is_raw_max``, ``mismatch/is_raw_min``, ``mismatch/is_applied_mean``,
    ``mismatch/masked_fraction``, ``mismatch/clipped_fraction``. See :func:`logp_diff_stats` and
    :func:`importance_weights` for the arguments and units.
    """
    return read_stats(mismatch_terms(*args, **kwargs)[1])


def mismatch_terms(
    train_logp: Tensor,
    rollout_logp: Tensor,
    mask: Tensor,
    level: ISLevel | str = ISLevel.SEQUENCE_GEOMEAN,
    mode: ISMode | str = ISMode.MASK,
    *,
    upper: float = 2.0,
    lower: float | None = None,
    prefix: str = "mismatch/",
) -> tuple[Tensor, DeviceStats]:
    """The importance weights of :func:`importance_terms` and the statistics of :func:`mismatch_metrics` (0-d
    tensors), computed once: a trainer corrects with the weights and logs the statistics of the same ratios."""
    out = {f"{prefix}{k}": v for k, v in logp_diff_terms(train_logp, rollout_logp, mask).items()}
    weights, stats = importance_terms(train_logp, rollout_logp, mask, level, mode, upper=upper, lower=lower)
    renames = {"raw_ratio_mean": "is_raw_mean", "raw_ratio_max": "is_raw_max", "raw_ratio_min": "is_raw_min",
               "applied_mean": "is_applied_mean"}
    out.update({f"{prefix}{renames.get(k, k)}": v for k, v in stats.items()})
    return weights, out
