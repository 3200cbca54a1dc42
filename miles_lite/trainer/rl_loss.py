"""Loss of one packed micro-batch: RL (policy + KL + entropy + distillation, IS-corrected) or SFT.

The algorithm math lives in `miles_lite.algo`; this module lines a micro-batch's response tokens
up into the padded `[B, T]` layout those functions take, and scales the micro-batch loss so that
the sum over micro-batches and data-parallel ranks equals the loss of the whole batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from miles_lite.algo import AggMode, LossConfig, expand_to_tokens, kl_penalty, sft_loss
from miles_lite.algo.device_stats import DeviceStats
from miles_lite.algo.losses import total_loss_terms
from miles_lite.algo.mismatch import mismatch_terms
from miles_lite.config.schema import AlgoConfig
from miles_lite.trainer.packing import PackedMicroBatch, PaddedLayout, padded_floats, to_device, to_padded
from miles_lite.types import TrainBatch


def loss_config(algo: AlgoConfig) -> LossConfig:
    """`algo.LossConfig` from the `algo` config group."""
    return LossConfig(
        policy_loss=algo.policy_loss, clip_low=algo.clip_low, clip_high=algo.clip_high,
        dual_clip_c=algo.dual_clip_c, kl_coef=algo.kl_coef, kl_estimator=algo.kl_estimator,
        entropy_coef=algo.entropy_coef, agg_mode=algo.agg_mode, agg_constant=algo.agg_constant,
        distill_coef=algo.distill_coef,
    )


@dataclass(frozen=True)
class BatchTotals:
    """Denominators of the whole (all data-parallel ranks) batch, for micro-batch loss scaling."""

    response_tokens: int  # tokens in the loss (environment replies of multi-turn rollouts excluded)
    sequences: int  # sequences with at least one token in the loss
    # Tokens in the loss, per sequence of the batch.
    per_sequence: tuple[int, ...] = ()

    @staticmethod
    def of(batch: TrainBatch) -> BatchTotals:
        counts = tuple(batch.loss_token_counts)
        return BatchTotals(sum(counts), sum(1 for n in counts if n > 0), counts)

    def share(self, mb: PackedMicroBatch, agg_mode: str) -> float:
        """Fraction of the batch loss this micro-batch's aggregated loss stands for.

        token_mean averages over tokens, the other modes over sequences, so the weight is the
        micro-batch's share of tokens or of sequences.
        """
        counts = [self.per_sequence[i] for i in mb.seq_indices] if self.per_sequence else mb.response_lengths
        if agg_mode == AggMode.TOKEN_MEAN:
            return sum(counts) / max(self.response_tokens, 1)
        return sum(1 for n in counts if n > 0) / max(self.sequences, 1)


def response_mask(mb: PackedMicroBatch, batch: TrainBatch, padded_mask: Tensor) -> Tensor:
    """The padded `[B, T]` mask of response tokens in the loss: `padded_mask` (real tokens) times the
    batch's loss masks (environment replies out)."""
    if batch.loss_masks is None:
        return padded_mask
    masks = to_device(padded_floats([batch.loss_masks[i] for i in mb.seq_indices]), padded_mask.device)
    return padded_mask * masks


def _rows(values: Sequence[Sequence[float]] | None, idx: Sequence[int]) -> list[Sequence[float]] | None:
    return None if values is None else [values[i] for i in idx]


def rl_micro_loss(
    logp_flat: Tensor,
    entropy_flat: Tensor | None,
    mb: PackedMicroBatch,
    batch: TrainBatch,
    algo: AlgoConfig,
    ref_logprobs: Sequence[Sequence[float]] | None,
    teacher_logprobs: Sequence[Sequence[float]] | None,
) -> tuple[Tensor, DeviceStats]:
    """RL loss of one micro-batch (aggregated over its own tokens) and its statistics (0-d tensors, read once
    a step: `algo.device_stats`).

    Args:
        logp_flat: `[R]` trainer log-probs of the micro-batch's response tokens (with grad).
        entropy_flat: `[R]` policy entropy per token, or None.
        mb: the micro-batch (its `seq_indices` index `batch`).
        batch: the train batch (rollout log-probs and advantages).
        algo: loss, KL, entropy, distillation and importance-sampling settings.
        ref_logprobs / teacher_logprobs: per-sequence floats for the whole batch, or None.

    The "old" policy of the PPO ratio is `batch.old_logprobs` (the trainer before the first of several
    updates on this batch) when set, else the trainer itself now (`logp.detach()`, ratio 1). The
    rollout/trainer gap (sampling mismatch, stale weights) is handled by the importance weights of
    `algo.is_*`, taken between that old policy and the engine's log-probs.
    """
    idx = mb.seq_indices
    # One layout (one index on the device) pads both the log-probs and the entropies.
    layout = PaddedLayout.of(mb.response_lengths, logp_flat.device)
    logp = layout.pad(logp_flat)
    mask = response_mask(mb, batch, layout.mask())
    old_rows = _rows(batch.old_logprobs, idx)
    dev = logp.device
    old = logp.detach() if old_rows is None else to_device(padded_floats(old_rows), dev)
    rollout = to_device(padded_floats(_rows(batch.rollout_logprobs, idx) or []), dev)
    adv = expand_to_tokens(to_device(torch.tensor([batch.advantages[i] for i in idx], dtype=torch.float32), dev),
                           mask)
    level = algo.is_level if algo.is_level != "none" else "token"
    lower = algo.is_lower if algo.is_mode == "mask" else None
    # One pass over the ratios gives the correction's weights and the mismatch statistics.
    weights, mismatch = mismatch_terms(old, rollout, mask, level, algo.is_mode, upper=algo.is_upper, lower=lower)
    is_w = weights if algo.is_level != "none" else None
    ref = _rows(ref_logprobs, idx)
    teacher = _rows(teacher_logprobs, idx)
    ref_t = to_device(padded_floats(ref), dev) if ref is not None else None
    teacher_t = to_device(padded_floats(teacher), dev) if teacher is not None else None
    entropy = layout.pad(entropy_flat) if entropy_flat is not None else None
    loss, stats = total_loss_terms(
        logp, old, adv, mask, loss_config(algo),
        ref_logp=ref_t if algo.kl_coef else None,
        entropy=entropy if algo.entropy_coef else None,
        teacher_logp=teacher_t if algo.distill_coef else None,
        is_weights=is_w,
    )
    stats.update(mismatch)
    with torch.no_grad():
        n = mask.sum().clamp_min(1.0)
        if entropy is not None:
            stats["entropy"] = (entropy.detach() * mask).sum() / n
        if ref_t is not None:
            stats["kl/ref_k3"] = (kl_penalty(old, ref_t, "k3", mask=mask) * mask).sum() / n
        stats["advantage/mean"] = (adv * mask).sum() / n
    return loss, stats


def sft_micro_loss(logp_flat: Tensor, mb: PackedMicroBatch, batch: TrainBatch) -> tuple[Tensor, DeviceStats]:
    """Cross-entropy (token mean of -logp) over the micro-batch's response tokens in the loss."""
    logp, mask = to_padded(logp_flat, mb.response_lengths)
    mask = response_mask(mb, batch, mask)
    loss = sft_loss(logp, mask, AggMode.TOKEN_MEAN)
    return loss, {"loss/sft": loss.detach()}


def reduce_stats(weighted: Sequence[tuple[float, dict[str, float]]]) -> dict[str, float]:
    """Combine per-micro-batch stats: `*_max` keys by max, `*_min` keys by min, others weighted by share."""
    out: dict[str, float] = {}
    total: dict[str, float] = {}
    for weight, stats in weighted:
        for key, value in stats.items():
            if key.endswith("_max"):
                out[key] = max(out.get(key, float("-inf")), value)
            elif key.endswith("_min"):
                out[key] = min(out.get(key, float("inf")), value)
            else:
                out[key] = out.get(key, 0.0) + weight * value
                total[key] = total.get(key, 0.0) + weight
    for key, weight in total.items():
        out[key] = out[key] / weight if weight > 0 else 0.0
    return out
