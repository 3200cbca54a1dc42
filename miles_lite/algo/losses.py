"""Per-token RL losses: PPO/GSPO policy loss, KL penalty, entropy bonus, SFT and on-policy distillation.

Layout: every per-token tensor is padded ``[B, T]`` (B completions, T response positions) with a
``mask [B, T]`` that is 1.0 on counted response tokens and 0.0 on padding/prompt. Log-probabilities
are natural-log probabilities (nats) of the sampled tokens. Positions outside the mask may hold any
value (even -inf): they are replaced before any arithmetic so they can produce neither NaN values
nor NaN gradients.

Every loss is a scalar to *minimise*. Reductions over tokens go through :func:`aggregate`; scaling
for gradient accumulation or data parallelism (global token counts) is the trainer's job.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from enum import StrEnum
from typing import Any

import torch
from torch import Tensor

from miles_lite.algo.choices import parse_choice
from miles_lite.algo.device_stats import DeviceStats, read_stats

# exp(20) ~ 4.9e8: far beyond any clip range, yet finite in float32/bfloat16, so a garbage logprob
# can never turn a ratio into inf (and inf * 0 into NaN).
_LOG_RATIO_CLAMP = 20.0


class AggMode(StrEnum):
    """How per-token values are reduced to a scalar."""

    TOKEN_MEAN = "token_mean"
    SEQ_MEAN_TOKEN_MEAN = "seq_mean_token_mean"
    SEQ_MEAN_TOKEN_SUM_NORM = "seq_mean_token_sum_norm"


class KLEstimator(StrEnum):
    """Per-token estimators of KL(pi || ref) from tokens sampled by the policy."""

    K1 = "k1"
    K2 = "k2"
    K3 = "k3"
    LOW_VAR_KL = "low_var_kl"


class RatioType(StrEnum):
    """Token-level (PPO) or sequence-level (GSPO) importance ratio."""

    TOKEN = "token"
    GSPO = "gspo"


class PolicyLossType(StrEnum):
    PPO = "ppo"
    GSPO = "gspo"



def _check_token_shapes(mask: Tensor, **tensors: Tensor | None) -> None:
    if not isinstance(mask, Tensor) or mask.dim() != 2:
        raise ValueError(f"mask must be a 2-D tensor [B, T]; got {getattr(mask, 'shape', type(mask))}")
    for name, t in tensors.items():
        if t is not None and tuple(t.shape) != tuple(mask.shape):
            raise ValueError(
                f"{name} must have the mask's shape [B, T] = {tuple(mask.shape)}; got {tuple(t.shape)} "
                "(pad per-token tensors to the same response length as the mask)"
            )


def _zero_outside(values: Tensor, mask: Tensor) -> Tensor:
    """``values`` where ``mask > 0`` else 0, without letting padding garbage reach the gradient."""
    return torch.where(mask > 0, values, torch.zeros_like(values))


def aggregate(
    values: Tensor, mask: Tensor, mode: AggMode | str = AggMode.TOKEN_MEAN, constant: float | None = None
) -> Tensor:
    """Reduce per-token values ``[B, T]`` to a scalar over masked tokens.

    Modes:

    * ``token_mean``: ``sum(values * mask) / sum(mask)``; every token weighs the same, so long
      responses dominate (DAPO's token-level loss).
    * ``seq_mean_token_mean``: mean over sequences of each sequence's token mean; every sequence
      weighs the same (original GRPO). Sequences with no masked token are left out of the mean.
    * ``seq_mean_token_sum_norm``: ``sum_t(values * mask) / constant`` per sequence, then the mean
      over all ``B`` sequences (Dr.GRPO). ``constant`` is a fixed length, usually the maximum
      response length, so the normaliser does not depend on the sampled lengths.

    Args:
        values: ``[B, T]`` per-token values (any unit; the result has the same unit).
        mask: ``[B, T]`` 1.0 on counted tokens, 0.0 elsewhere.
        mode: an :class:`AggMode` or its string value.
        constant: tokens; required (> 0) for ``seq_mean_token_sum_norm``, ignored otherwise.

    Returns:
        0-d tensor; 0 when the mask is empty.
    """
    agg = parse_choice(AggMode, mode, "agg_mode")
    _check_token_shapes(mask, values=values)
    m = mask.to(values.dtype)
    masked = _zero_outside(values, m) * m
    if agg is AggMode.TOKEN_MEAN:
        return masked.sum() / m.sum().clamp_min(1.0)
    if agg is AggMode.SEQ_MEAN_TOKEN_MEAN:
        lengths = m.sum(dim=-1)
        per_seq = masked.sum(dim=-1) / lengths.clamp_min(1.0)
        has_tokens = (lengths > 0).to(values.dtype)
        return (per_seq * has_tokens).sum() / has_tokens.sum().clamp_min(1.0)
    if constant is None or constant <= 0:
        raise ValueError(
            f"agg_mode='seq_mean_token_sum_norm' needs a positive constant (Dr.GRPO uses the maximum "
            f"response length, e.g. the rollout's max new tokens); got constant={constant!r}"
        )
    return masked.sum() / (float(constant) * max(values.shape[0], 1))


@dataclass(frozen=True)
class PolicyLossStats:
    """Diagnostics of :func:`policy_loss`, token-weighted over masked tokens (plain floats).

    Attributes:
        clip_frac_low: share of tokens with ``A < 0`` and ratio below ``1 - clip_low`` (no gradient).
        clip_frac_high: share of tokens with ``A > 0`` and ratio above ``1 + clip_high`` (no gradient).
        dual_clip_frac: share of tokens with ``A < 0`` whose loss hit the dual-clip cap ``-c * A``.
        approx_kl: mean k3 estimate of KL(old || new) in nats per token, from the token ratios.
        ratio_mean / ratio_max / ratio_min: the ratio the loss used (token, or GSPO sequence ratio
            repeated on each of its tokens).
    """

    clip_frac_low: float
    clip_frac_high: float
    dual_clip_frac: float
    approx_kl: float
    ratio_mean: float
    ratio_max: float
    ratio_min: float

    def as_dict(self, prefix: str = "policy/") -> dict[str, float]:
        return {f"{prefix}{k}": v for k, v in asdict(self).items()}


def _k3_from_log_ratio(log_ratio: Tensor) -> Tensor:
    """``exp(x) - x - 1`` computed as ``expm1(x) - x``: exact near 0 and never negative by rounding."""
    return torch.expm1(log_ratio) - log_ratio


def _check_clip_args(clip_low: float, clip_high: float, dual_clip_c: float | None) -> None:
    if not 0.0 < clip_low < 1.0:
        raise ValueError(f"clip_low must be in (0, 1) so that 1 - clip_low > 0; got {clip_low}")
    if clip_high <= 0.0:
        raise ValueError(f"clip_high must be > 0; got {clip_high}")
    if dual_clip_c is not None and dual_clip_c <= 1.0:
        raise ValueError(f"dual_clip_c must be > 1 (typically 3), or None to disable; got {dual_clip_c}")


def policy_loss(*args: Any, **kwargs: Any) -> tuple[Tensor, PolicyLossStats]:
    """:func:`policy_loss_terms` (same arguments) with its statistics read as :class:`PolicyLossStats` (floats)."""
    loss, terms = policy_loss_terms(*args, **kwargs)
    return loss, PolicyLossStats(**read_stats(terms))


def policy_loss_terms(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip_c: float | None = None,
    ratio_type: RatioType | str = RatioType.TOKEN,
    is_weights: Tensor | None = None,
    agg_mode: AggMode | str = AggMode.TOKEN_MEAN,
    agg_constant: float | None = None,
) -> tuple[Tensor, DeviceStats]:
    """Clipped surrogate policy loss (PPO / GRPO / DAPO / GSPO).

    Per token, with ratio ``r`` and advantage ``A``::

        loss_t = max(-A * r, -A * clip(r, 1 - clip_low, 1 + clip_high))

    ``clip_high > clip_low`` is DAPO's clip-higher (e.g. 0.2 / 0.28): it lets low-probability tokens
    with positive advantage grow further, which slows entropy collapse. With ``dual_clip_c = c``
    (Dual-clip PPO, c > 1), tokens with ``A < 0`` have their loss capped at ``-c * A`` so a huge
    ratio cannot produce an unbounded update.

    Ratios:

    * ``token``: ``r_t = exp(logp_t - old_logp_t)``.
    * ``gspo``: sequence ratio ``s_i = exp(mean_t(logp - old_logp))`` (length-normalised), used in
      the GSPO-token form ``s_i,t = sg(s_i) * exp(logp_t - sg(logp_t))``: its value is ``s_i`` on
      every token and its gradient is ``s_i * grad(logp_t)``. With sequence-constant advantages and
      ``agg_mode='seq_mean_token_mean'`` this is exactly the GSPO objective. GSPO's clip ranges are
      far tighter than PPO's because ``s_i`` is a per-token geometric mean: the paper uses
      ``clip_low = 3e-4``, ``clip_high = 4e-4``.

    Args:
        logp: ``[B, T]`` log-probs (nats) of the sampled tokens under the current policy (with grad).
        old_logp: ``[B, T]`` log-probs under the policy that produced the data (treated as constant).
        advantages: ``[B, T]`` per-token advantages (constant).
        mask: ``[B, T]`` 1.0 on counted response tokens.
        clip_low / clip_high / dual_clip_c / ratio_type: see above.
        is_weights: ``[B, T]`` importance-sampling correction weights (e.g. train/inference
            mismatch, see ``mismatch.importance_weights``) multiplying the per-token loss; detached.
        agg_mode / agg_constant: reduction, see :func:`aggregate`.

    Returns:
        ``(loss, stats)``: 0-d loss (advantage units) and the fields of :class:`PolicyLossStats` as 0-d tensors
        (read them with ``device_stats.read_stats``). Log-ratios are clamped to ``[-20, 20]`` before ``exp`` so
        the loss stays finite.
    """
    kind = parse_choice(RatioType, ratio_type, "ratio_type")
    _check_token_shapes(mask, logp=logp, old_logp=old_logp, advantages=advantages, is_weights=is_weights)
    _check_clip_args(clip_low, clip_high, dual_clip_c)

    keep = mask > 0
    safe_logp = _zero_outside(logp, keep)
    token_log_ratio = (safe_logp - _zero_outside(old_logp.detach(), keep)).clamp(
        -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP
    )
    if kind is RatioType.TOKEN:
        log_ratio = token_log_ratio
    else:
        lengths = keep.sum(dim=-1, keepdim=True).clamp_min(1).to(logp.dtype)
        seq_log_ratio = token_log_ratio.sum(dim=-1, keepdim=True) / lengths  # [B, 1]
        # Value: the sequence log-ratio on every token; gradient: only through this token's logp.
        log_ratio = _zero_outside(seq_log_ratio.detach() + safe_logp - safe_logp.detach(), keep)
    ratio = torch.exp(log_ratio)

    adv = _zero_outside(advantages.detach(), keep)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(unclipped, clipped)
    if dual_clip_c is not None:
        capped = torch.minimum(per_token, -dual_clip_c * adv)
        per_token = torch.where(adv < 0, capped, per_token)
    if is_weights is not None:
        per_token = per_token * _zero_outside(is_weights.detach(), keep)
    loss = aggregate(per_token, mask, agg_mode, agg_constant)

    with torch.no_grad():
        r = ratio.detach()
        c = math.inf if dual_clip_c is None else dual_clip_c
        per_token_stats = [
            (adv < 0) & (r < 1.0 - clip_low),
            (adv > 0) & (r > 1.0 + clip_high),
            (adv < 0) & (r > c),
            _k3_from_log_ratio(token_log_ratio.detach()),
            r,
        ]
        means = [aggregate(v.to(r.dtype), mask) for v in per_token_stats]
        has, zero = keep.any(), torch.zeros((), dtype=r.dtype, device=r.device)  # empty mask: report 0
        r_max = torch.where(has, torch.where(keep, r, -math.inf).amax(), zero)
        r_min = torch.where(has, torch.where(keep, r, math.inf).amin(), zero)
    names = [f.name for f in fields(PolicyLossStats)]
    return loss, dict(zip(names, [*means, r_max, r_min], strict=True))


def kl_penalty(
    logp: Tensor, ref_logp: Tensor, estimator: KLEstimator | str = KLEstimator.K3, *,
    mask: Tensor | None = None,
) -> Tensor:
    """Per-token estimate of KL(pi || ref) from tokens sampled by pi (nats per token).

    With ``x = ref_logp - logp`` (log of ref / pi at the sampled token):

    * ``k1``: ``-x = logp - ref_logp``; unbiased, high variance, can be negative.
    * ``k2``: ``0.5 * x**2``; biased, low variance, >= 0.
    * ``k3``: ``exp(x) - x - 1`` (Schulman's estimator); unbiased, low variance, >= 0.
    * ``low_var_kl``: ``k3`` with ``x`` clamped to ``[-20, 20]`` and the result to ``[-10, 10]``
      (the bounded variant common in GRPO trainers; stops a single outlier token dominating).

    Args:
        logp: ``[B, T]`` policy log-probs (with grad).
        ref_logp: ``[B, T]`` reference-model log-probs (treated as constant).
        estimator: a :class:`KLEstimator` or its string value.
        mask: optional ``[B, T]``; positions outside it are set to 0 (and may hold garbage).

    Returns:
        ``[B, T]`` per-token KL estimate; reduce it with :func:`aggregate`.
    """
    est = parse_choice(KLEstimator, estimator, "kl_estimator")
    _check_token_shapes(torch.ones_like(logp) if mask is None else mask, logp=logp, ref_logp=ref_logp)
    if mask is not None:
        logp, ref_logp = _zero_outside(logp, mask), _zero_outside(ref_logp, mask)
    x = ref_logp.detach() - logp
    if est is KLEstimator.K1:
        return -x
    if est is KLEstimator.K2:
        return 0.5 * x.square()
    if est is KLEstimator.K3:
        return _k3_from_log_ratio(x)
    return _k3_from_log_ratio(x.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)).clamp(-10.0, 10.0)


def entropy_bonus(
    entropy: Tensor, mask: Tensor, coef: float, agg_mode: AggMode | str = AggMode.TOKEN_MEAN,
    agg_constant: float | None = None,
) -> Tensor:
    """Loss term ``-coef * aggregate(entropy)``: negative so that minimising it raises entropy.

    Args:
        entropy: ``[B, T]`` per-token entropy of the policy (nats), with grad.
        mask: ``[B, T]`` counted tokens.
        coef: bonus weight (>= 0 encourages exploration).
    """
    return -coef * aggregate(entropy, mask, agg_mode, agg_constant)


def sft_loss(
    logp: Tensor, mask: Tensor, agg_mode: AggMode | str = AggMode.TOKEN_MEAN,
    agg_constant: float | None = None,
) -> Tensor:
    """Negative log-likelihood of the target tokens, ``aggregate(-logp)`` (nats)."""
    return aggregate(-logp, mask, agg_mode, agg_constant)


def distillation_loss(*args: Any, **kwargs: Any) -> tuple[Tensor, float]:
    """:func:`distillation_terms` (same arguments) with the reverse KL read as a float."""
    loss, reverse_kl = distillation_terms(*args, **kwargs)
    return loss, float(reverse_kl)


def distillation_terms(
    logp: Tensor,
    teacher_logp: Tensor,
    mask: Tensor,
    agg_mode: AggMode | str = AggMode.TOKEN_MEAN,
    agg_constant: float | None = None,
    *,
    sampler_logp: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """On-policy distillation with a per-token reverse-KL reward.

    The student sampled the tokens; each token gets the reward ``adv_t = teacher_logp_t -
    student_logp_t`` (the negated one-sample estimate of KL(student || teacher) at that token) and the
    student is trained with the REINFORCE term ``-(sg(adv_t) * logp_t)``, whose expected gradient is
    that of the reverse KL. Every token gets dense credit from the teacher instead of one sparse
    outcome reward (the on-policy distillation recipe published by Thinking Machines).

    Args:
        logp: ``[B, T]`` student log-probs of its own sampled tokens (with grad).
        teacher_logp: ``[B, T]`` teacher log-probs of the same tokens (constant).
        mask: ``[B, T]`` counted tokens.
        agg_mode / agg_constant: reduction, see :func:`aggregate`.
        sampler_logp: ``[B, T]`` optional student log-probs recorded at sampling time. When given the
            reward uses them (a fixed per-token reward, as in the published recipe, unaffected by
            later updates within the step); otherwise it uses the detached ``logp``.

    Returns:
        ``(loss, reverse_kl)``: 0-d loss and the token-mean reverse-KL estimate (nats per token, a 0-d tensor).
    """
    _check_token_shapes(mask, logp=logp, teacher_logp=teacher_logp, sampler_logp=sampler_logp)
    student = logp if sampler_logp is None else sampler_logp
    adv = (_zero_outside(teacher_logp, mask) - _zero_outside(student, mask)).detach()
    loss = aggregate(-(adv * _zero_outside(logp, mask)), mask, agg_mode, agg_constant)
    return loss, aggregate(-adv, mask).detach()


@dataclass(frozen=True)
class LossConfig:
    """Weights and options of :func:`total_loss`.

    ``policy_loss`` is ``ppo`` (token ratio) or ``gspo`` (sequence ratio); clip arguments as in
    :func:`policy_loss`; ``agg_mode`` / ``agg_constant`` (see :func:`aggregate`) reduce every term. A
    zero ``kl_coef`` / ``entropy_coef`` / ``distill_coef`` disables that term; a non-zero one needs
    ``ref_logp`` / ``entropy`` / ``teacher_logp`` passed to :func:`total_loss`.
    """

    policy_loss: PolicyLossType | str = PolicyLossType.PPO
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip_c: float | None = None
    kl_coef: float = 0.0
    kl_estimator: KLEstimator | str = KLEstimator.K3
    entropy_coef: float = 0.0
    agg_mode: AggMode | str = AggMode.TOKEN_MEAN
    agg_constant: float | None = None
    distill_coef: float = 0.0

    def __post_init__(self) -> None:
        # Normalise strings to enums once, so a typo fails at config time rather than mid-step.
        object.__setattr__(self, "policy_loss", parse_choice(PolicyLossType, self.policy_loss, "policy_loss"))
        object.__setattr__(self, "kl_estimator", parse_choice(KLEstimator, self.kl_estimator, "kl_estimator"))
        object.__setattr__(self, "agg_mode", parse_choice(AggMode, self.agg_mode, "agg_mode"))
        _check_clip_args(self.clip_low, self.clip_high, self.dual_clip_c)
        for name in ("kl_coef", "distill_coef"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0; got {getattr(self, name)}")
        if self.agg_mode is AggMode.SEQ_MEAN_TOKEN_SUM_NORM and (self.agg_constant or 0) <= 0:
            raise ValueError(
                "agg_mode='seq_mean_token_sum_norm' needs agg_constant > 0 (the maximum response length)"
            )


def total_loss(*args: Any, **kwargs: Any) -> tuple[Tensor, dict[str, float]]:
    """:func:`total_loss_terms` (same arguments) with its statistics read as floats (one host sync)."""
    loss, stats = total_loss_terms(*args, **kwargs)
    return loss, read_stats(stats)


def total_loss_terms(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    config: LossConfig,
    *,
    ref_logp: Tensor | None = None,
    entropy: Tensor | None = None,
    teacher_logp: Tensor | None = None,
    is_weights: Tensor | None = None,
) -> tuple[Tensor, DeviceStats]:
    """``policy + kl_coef * kl - entropy_coef * entropy + distill_coef * distill`` for one micro-batch.

    All inputs are ``[B, T]`` (see :func:`policy_loss`). The distillation reward uses ``old_logp`` as
    the sampling-time student log-probs.

    Returns:
        ``(loss, stats)``: 0-d loss and 0-d tensor stats keyed ``loss/*``, ``policy/*``, ``distill/*``.

    Raises:
        ValueError: a term has a non-zero weight but its input is missing.
    """
    for coef_name, arg_name, tensor in (
        ("kl_coef", "ref_logp", ref_logp),
        ("entropy_coef", "entropy", entropy),
        ("distill_coef", "teacher_logp", teacher_logp),
    ):
        coef = getattr(config, coef_name)
        if coef != 0 and tensor is None:
            raise ValueError(f"{coef_name}={coef} needs {arg_name}=...; pass it or set {coef_name}=0")

    mode, const = config.agg_mode, config.agg_constant
    ratio_type = RatioType.GSPO if config.policy_loss is PolicyLossType.GSPO else RatioType.TOKEN
    pg, pg_stats = policy_loss_terms(
        logp, old_logp, advantages, mask, clip_low=config.clip_low, clip_high=config.clip_high,
        dual_clip_c=config.dual_clip_c, ratio_type=ratio_type, is_weights=is_weights,
        agg_mode=mode, agg_constant=const,
    )
    terms: dict[str, Tensor] = {"loss/policy": pg}
    stats: DeviceStats = {f"policy/{k}": v for k, v in pg_stats.items()}
    if config.kl_coef != 0 and ref_logp is not None:
        kl = aggregate(kl_penalty(logp, ref_logp, config.kl_estimator, mask=mask), mask, mode, const)
        terms["loss/kl"] = config.kl_coef * kl
    if config.entropy_coef != 0 and entropy is not None:
        terms["loss/entropy"] = entropy_bonus(entropy, mask, config.entropy_coef, mode, const)
    if config.distill_coef != 0 and teacher_logp is not None:
        distill, stats["distill/reverse_kl"] = distillation_terms(
            logp, teacher_logp, mask, mode, const, sampler_logp=old_logp
        )
        terms["loss/distill"] = config.distill_coef * distill

    loss = torch.stack(list(terms.values())).sum()
    stats["loss/total"] = loss.detach()
    stats.update({name: t.detach() for name, t in terms.items()})
    return loss, stats
