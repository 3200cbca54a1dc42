"""From scored groups to the trainer's batch: advantages, zero-signal accounting, reward statistics."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from miles_lite.algo.advantages import compute_advantages
from miles_lite.config.schema import AlgoConfig
from miles_lite.types import Group, TrainBatch


def reward_stats(groups: Sequence[Group]) -> dict[str, object]:
    """Reward mean/std, exact accuracy and per-reward value lists over every sample (for metrics)."""
    samples = [s for g in groups for s in g.samples]
    totals = torch.tensor([s.reward for s in samples], dtype=torch.float64)
    stats: dict[str, object] = {
        "reward/mean": float(totals.mean()) if len(samples) else 0.0,
        "reward/std": float(totals.std(unbiased=False)) if len(samples) else 0.0,
        "reward/exact_accuracy": (sum(s.rewards.get("exact_check", 0.0) for s in samples) / len(samples))
        if samples else 0.0,
        "rollout/response_length_mean": (sum(len(s.response_ids) for s in samples) / len(samples)) if samples else 0.0,
    }
    names = sorted({k for s in samples for k in s.rewards if k != "total"})
    for name in names:
        stats[f"reward/values/{name}"] = [s.rewards.get(name, 0.0) for s in samples]
    return stats


def build_train_batch(groups: Sequence[Group], algo: AlgoConfig) -> tuple[TrainBatch | None, dict[str, float]]:
    """Advantages per completion (the group is its own baseline) and the ragged `TrainBatch`.

    Zero-signal groups (all rewards equal) are always counted; with `algo.drop_zero_signal` they are
    left out of the batch. Returns `(None, stats)` when nothing is left to train on.
    """
    sizes = {len(g.samples) for g in groups}
    if len(sizes) != 1:
        raise ValueError(f"groups of unequal sizes {sorted(sizes)}: every prompt needs rollout.group_size samples")
    group_size = sizes.pop()
    rewards = torch.tensor([s.reward for g in groups for s in g.samples], dtype=torch.float64)
    result = compute_advantages(rewards, group_size, algo.advantage_estimator, std_normalize=algo.std_normalize)
    keep = result.keep_mask if algo.drop_zero_signal else torch.ones_like(result.keep_mask)
    stats = {"algo/zero_signal_share": result.zero_signal_share,
             "algo/zero_signal_groups": float(result.zero_signal_mask.sum()),
             "algo/groups": float(len(groups))}
    samples = [s for g in groups for s in g.samples]
    chosen = [i for i in range(len(samples)) if bool(keep[i]) and samples[i].response_ids]
    stats["algo/trained_sequences"] = float(len(chosen))
    if not chosen:
        return None, stats
    batch = TrainBatch(
        tokens=[samples[i].prompt_ids + samples[i].response_ids for i in chosen],
        prompt_lengths=[len(samples[i].prompt_ids) for i in chosen],
        rollout_logprobs=[list(samples[i].rollout_logprobs) for i in chosen],
        advantages=[float(result.advantages[i]) for i in chosen],
    )
    return batch, stats


def rollout_stats(stats: Any) -> dict[str, object]:
    """The rollout manager's per-call stats under the metric keys the registry knows."""
    return {
        "rollout/tokens_per_second": stats.tokens_per_s,
        "rollout/generated_tokens": float(stats.tokens_generated),
        "rollout/request_latency_seconds": list(stats.latencies_s),
        "rollout/retried_requests": float(stats.retries),
        "rollout/dynamic_sampling_rounds": float(stats.sampling_rounds),
        "rollout/dropped_groups": float(stats.dropped_groups),
        "rollout/wall_seconds": stats.wall_s,
    }
