"""Group-relative advantage estimators for outcome (one scalar per completion) rewards.

Layout: ``rewards [B]`` holds one reward per completion; the ``G = group_size`` completions sampled
for the same prompt are contiguous, so group ``g`` is ``rewards[g * G:(g + 1) * G]`` and
``B = num_groups * G``. Advantages are per sequence ``[B]`` (same unit as the reward, or unitless
after std normalisation); :func:`expand_to_tokens` broadcasts them to the padded ``[B, T]`` layout
that the losses consume.

A group whose rewards are all equal (e.g. 0/8 or 8/8 correct) carries no learning signal for a
group baseline: every group estimator returns exactly zero advantages for it, and
:class:`AdvantageResult` reports those groups so the caller can drop them (DAPO-style dynamic
sampling) instead of spending compute on zero gradients. ``reinforce_pp`` has no group baseline
(its baseline is the whole batch), so such a group still gets advantages there; it is reported all
the same.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import torch
from torch import Tensor


class AdvantageEstimator(StrEnum):
    """Which baseline / normalisation turns group rewards into advantages."""

    GRPO = "grpo"
    DR_GRPO = "dr_grpo"
    RLOO = "rloo"
    REINFORCE_PP_BASELINE = "reinforce_pp_baseline"
    REINFORCE_PP = "reinforce_pp"


# Estimators whose baseline is the prompt's own group: they need two or more samples per prompt.
GROUP_ESTIMATORS = frozenset({AdvantageEstimator.GRPO, AdvantageEstimator.DR_GRPO, AdvantageEstimator.RLOO,
                              AdvantageEstimator.REINFORCE_PP_BASELINE})


@dataclass(frozen=True)
class AdvantageResult:
    """Output of :func:`compute_advantages`.

    Attributes:
        advantages: ``[B]`` per-completion advantage, exactly 0 for zero-signal groups.
        zero_signal_mask: ``[B // G]`` bool, True for groups whose rewards are all equal.
        zero_signal_share: fraction of groups (0..1) that are zero-signal.
        keep_mask: ``[B]`` bool, False for completions of zero-signal groups (see
            :func:`drop_zero_signal`).
    """

    advantages: Tensor
    zero_signal_mask: Tensor
    zero_signal_share: float
    keep_mask: Tensor


def drop_zero_signal(zero_signal_mask: Tensor, group_size: int) -> Tensor:
    """Per-completion keep mask from a per-group zero-signal mask.

    Args:
        zero_signal_mask: ``[num_groups]`` bool, True where a group has no reward variance.
        group_size: completions per group ``G``.

    Returns:
        ``[num_groups * G]`` bool, False for every completion of a zero-signal group. Index the
        batch with it to drop those groups before training.
    """
    if zero_signal_mask.dim() != 1 or zero_signal_mask.dtype != torch.bool:
        raise ValueError(
            f"zero_signal_mask must be a 1-D bool tensor [num_groups]; got shape "
            f"{tuple(zero_signal_mask.shape)} dtype {zero_signal_mask.dtype}"
        )
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1; got {group_size}")
    return (~zero_signal_mask).repeat_interleave(group_size)


def _parse_estimator(estimator: AdvantageEstimator | str) -> AdvantageEstimator:
    try:
        return AdvantageEstimator(estimator)
    except ValueError:
        choices = [e.value for e in AdvantageEstimator]
        raise ValueError(f"estimator={estimator!r} is not supported; choose one of {choices}") from None


def _validate(rewards: Tensor, group_size: int, eps: float, min_group: int) -> Tensor:
    """Check shapes/values and return the rewards as a floating tensor."""
    if not isinstance(rewards, Tensor) or rewards.dim() != 1:
        shape = tuple(rewards.shape) if isinstance(rewards, Tensor) else type(rewards).__name__
        raise ValueError(f"rewards must be a 1-D tensor [B] (one reward per completion); got {shape}")
    if rewards.numel() == 0:
        raise ValueError("rewards is empty; pass at least one group of completions")
    if not isinstance(group_size, int) or group_size < min_group:
        # With G = 1 the group baseline equals the reward itself, so every advantage would be 0
        # (and the unbiased std would be NaN): there is nothing to learn from.
        raise ValueError(
            f"group_size must be an int >= {min_group} for this estimator; got {group_size!r} "
            "(sample at least 2 completions per prompt, or use estimator='reinforce_pp')"
        )
    if rewards.numel() % group_size != 0:
        raise ValueError(
            f"rewards has B={rewards.numel()} entries, not divisible by group_size={group_size}; pass "
            "all G completions of every prompt, contiguously (B = num_groups * group_size)"
        )
    if eps < 0:
        raise ValueError(f"eps must be >= 0; got {eps}")
    if not rewards.is_floating_point():
        rewards = rewards.to(torch.get_default_dtype())
    if not bool(torch.isfinite(rewards).all()):
        raise ValueError("rewards contains NaN or inf; fix the reward function output before training")
    return rewards


def compute_advantages(
    rewards: Tensor,
    group_size: int,
    estimator: AdvantageEstimator | str,
    *,
    std_normalize: bool = True,
    eps: float = 1e-6,
    zero_signal_atol: float = 1e-8,
) -> AdvantageResult:
    """Per-completion advantages from group rewards.

    Estimators (``r`` = rewards of one group, ``G`` = group size):

    * ``grpo``: ``(r - mean(r)) / (std(r) + eps)``. ``std`` is the *unbiased* sample std
      (``torch.std``, divisor ``G - 1``), matching DeepSeek's / TRL's implementation; it makes the
      advantages smaller by ``sqrt((G - 1) / G)`` than the population std would. With
      ``std_normalize=False`` this is ``dr_grpo``.
    * ``dr_grpo``: ``r - mean(r)`` (Dr.GRPO drops the std division, which over-weights groups
      that are nearly all right or all wrong). ``std_normalize`` is ignored.
    * ``rloo``: ``r_i - mean_{j != i} r_j`` (leave-one-out baseline, unbiased). Equals
      ``G / (G - 1) * (r_i - mean(r))``. ``std_normalize`` is ignored.
    * ``reinforce_pp_baseline``: ``r - mean(r)`` per group, then whitened across the batch,
      ``(a - mean) / (std + eps)`` with the population std. Mean and std are taken over the
      completions of groups *with* signal only, and zero-signal groups stay exactly 0: whitening them
      too would shift their zero advantage by ``-mean / std`` and inject a spurious gradient.
      ``std_normalize`` is ignored.
    * ``reinforce_pp``: REINFORCE++ (Hu et al., 2025) with outcome rewards: no per-prompt baseline;
      the rewards are whitened over the whole batch ``b`` (every completion of every group),
      ``(r_i - mean_b(r)) / (std_b(r) + eps)`` with the population std. Works with ``G = 1``. A
      zero-signal group is not zeroed: all its members get the same advantage, positive when the
      group is above the batch mean. (A KL penalty, which REINFORCE++ folds into the reward, is
      ``algo.kl_coef`` in the loss here.) ``std_normalize`` is ignored.

    Args:
        rewards: ``[B]`` one scalar reward per completion (integer rewards are cast to float);
            groups of ``group_size`` are contiguous.
        group_size: completions per prompt ``G`` (>= 2; >= 1 for ``reinforce_pp``).
        estimator: an :class:`AdvantageEstimator` or its string value.
        std_normalize: divide by the group std (``grpo`` only).
        eps: added to the std before dividing, guards near-constant groups (reward units).
        zero_signal_atol: a group is zero-signal when ``max(r) - min(r) <= zero_signal_atol``.

    Returns:
        :class:`AdvantageResult` with ``advantages [B]`` in the rewards' dtype and device.

    Raises:
        ValueError: bad shapes, ``B`` not divisible by ``group_size``, ``group_size < 2``,
            non-finite rewards or an unknown estimator.
    """
    est = _parse_estimator(estimator)
    rewards = _validate(rewards, group_size, eps, min_group=2 if est in GROUP_ESTIMATORS else 1)
    num_groups = rewards.numel() // group_size
    r = rewards.reshape(num_groups, group_size)

    # A group of one has no spread to judge: never zero-signal.
    zero_signal = ((r.amax(dim=1) - r.amin(dim=1)) <= zero_signal_atol) & (group_size > 1)  # [num_groups]
    zero_col = zero_signal.unsqueeze(1)  # [num_groups, 1], broadcasts over group members
    centered = r - r.mean(dim=1, keepdim=True)

    if est is AdvantageEstimator.GRPO and std_normalize:
        std = r.std(dim=1, keepdim=True)  # unbiased (divisor G - 1), as in DeepSeek's GRPO code
        # Zero-signal groups get denominator 1 so no 0 / eps blow-up can appear even transiently.
        adv = centered / torch.where(zero_col, torch.ones_like(std), std + eps)
    elif est in (AdvantageEstimator.GRPO, AdvantageEstimator.DR_GRPO):
        adv = centered
    elif est is AdvantageEstimator.RLOO:
        leave_one_out_mean = (r.sum(dim=1, keepdim=True) - r) / (group_size - 1)
        adv = r - leave_one_out_mean
    elif est is AdvantageEstimator.REINFORCE_PP:
        centered_batch = r - r.mean()
        adv = centered_batch / (centered_batch.square().mean().sqrt() + eps)
    else:  # REINFORCE_PP_BASELINE
        active = (~zero_col).expand_as(r).to(r.dtype)
        count = active.sum().clamp_min(1.0)
        # Masked mean/var without boolean indexing: stays on device, no host sync.
        mean = (centered * active).sum() / count
        var = (((centered - mean) ** 2) * active).sum() / count
        adv = (centered - mean) / (var.sqrt() + eps)

    if est in GROUP_ESTIMATORS:
        # Exact zeros for zero-signal groups, whatever rounding the mean above produced.
        adv = torch.where(zero_col, torch.zeros_like(adv), adv)
    return AdvantageResult(
        advantages=adv.reshape(-1),
        zero_signal_mask=zero_signal,
        zero_signal_share=float(zero_signal.to(torch.float32).mean().item()),
        keep_mask=drop_zero_signal(zero_signal, group_size),
    )


def expand_to_tokens(advantages: Tensor, mask: Tensor) -> Tensor:
    """Broadcast per-sequence advantages to response tokens.

    Args:
        advantages: ``[B]`` one advantage per completion.
        mask: ``[B, T]`` 1.0 on response tokens, 0.0 on padding/prompt.

    Returns:
        ``[B, T]`` in the advantages' dtype: ``advantages[b]`` on masked tokens, 0 elsewhere.
    """
    if advantages.dim() != 1 or mask.dim() != 2 or advantages.shape[0] != mask.shape[0]:
        raise ValueError(
            f"expand_to_tokens needs advantages [B] and mask [B, T] with the same B; got advantages "
            f"{tuple(advantages.shape)} and mask {tuple(mask.shape)}"
        )
    return advantages.unsqueeze(1) * mask.to(advantages.dtype)


def ragged_advantages(groups: list[list[float]], estimator: AdvantageEstimator | str, *, std_normalize: bool = True,
                      eps: float = 1e-6, zero_signal_atol: float = 1e-8) -> tuple[list[float], list[bool]]:
    """:func:`compute_advantages` for groups of different sizes (an agent whose sample was dropped leaves its
    group short): the same estimators, exactly. Returns the flat advantages (groups in order) and each group's
    zero-signal flag. Group estimators compute per group; a group of one sample has no spread (zero-signal,
    advantage 0); `reinforce_pp` whitens over every completion; `reinforce_pp_baseline` whitens the centred
    rewards of the groups with signal over all of them. Empty groups contribute nothing.
    """
    est = _parse_estimator(estimator)
    flat: list[float] = []
    zero: list[bool] = []
    centered: list[float] = []
    for rewards in groups:
        if not rewards:
            zero.append(True)
            continue
        r = torch.tensor(rewards, dtype=torch.float64)
        no_signal = len(rewards) < 2 or float(r.max() - r.min()) <= zero_signal_atol
        zero.append(no_signal)
        if est is AdvantageEstimator.REINFORCE_PP:
            continue
        if no_signal or est is AdvantageEstimator.REINFORCE_PP_BASELINE:
            c = (r - r.mean()) if not no_signal else torch.zeros_like(r)
            centered.extend(c.tolist())
            if est is not AdvantageEstimator.REINFORCE_PP_BASELINE:
                flat.extend([0.0] * len(rewards))
            continue
        flat.extend(compute_advantages(r, len(rewards), est, std_normalize=std_normalize, eps=eps,
                                       zero_signal_atol=zero_signal_atol).advantages.tolist())
    if est is AdvantageEstimator.REINFORCE_PP:
        every = torch.tensor([x for g in groups for x in g], dtype=torch.float64)
        if every.numel():
            c = every - every.mean()
            flat = (c / (c.square().mean().sqrt() + eps)).tolist()
    elif est is AdvantageEstimator.REINFORCE_PP_BASELINE:
        active = torch.tensor([not z for g, z in zip(groups, zero, strict=True) for _ in g], dtype=torch.float64)
        c = torch.tensor(centered, dtype=torch.float64)
        if c.numel():
            count = active.sum().clamp_min(1.0)
            mean = (c * active).sum() / count
            var = (((c - mean) ** 2) * active).sum() / count
            flat = torch.where(active.bool(), (c - mean) / (var.sqrt() + eps), torch.zeros_like(c)).tolist()
    return flat, zero
