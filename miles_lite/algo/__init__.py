"""RL algorithm math: advantages, losses and train/inference mismatch correction (pure torch). A library: it
imports nothing of the package but the shared types.
"""

from miles_lite.algo.advantages import (
    AdvantageEstimator,
    AdvantageResult,
    compute_advantages,
    drop_zero_signal,
    expand_to_tokens,
)
from miles_lite.algo.losses import (
    AggMode,
    KLEstimator,
    LossConfig,
    PolicyLossStats,
    PolicyLossType,
    RatioType,
    aggregate,
    distillation_loss,
    entropy_bonus,
    kl_penalty,
    policy_loss,
    sft_loss,
    total_loss,
)
from miles_lite.algo.mismatch import (
    ISLevel,
    ISMode,
    ISResult,
    importance_weights,
    logp_diff_stats,
    mismatch_metrics,
)

__all__ = [
    "AdvantageEstimator",
    "AdvantageResult",
    "AggMode",
    "ISLevel",
    "ISMode",
    "ISResult",
    "KLEstimator",
    "LossConfig",
    "PolicyLossStats",
    "PolicyLossType",
    "RatioType",
    "aggregate",
    "compute_advantages",
    "distillation_loss",
    "drop_zero_signal",
    "entropy_bonus",
    "expand_to_tokens",
    "importance_weights",
    "kl_penalty",
    "logp_diff_stats",
    "mismatch_metrics",
    "policy_loss",
    "sft_loss",
    "total_loss",
]
