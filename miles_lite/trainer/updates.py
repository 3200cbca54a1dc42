"""Several optimizer steps per rollout batch: which sequences each step trains on, and one set of stats.

PPO-style training reuses a rollout batch for `updates` mini-batches per pass and `epochs` passes.
The trainer computes the "old" policy's log-probs once before the first step (`TrainerActor.train_step`);
this module only plans the mini-batches and folds the per-step statistics into the step's record.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from miles_lite.trainer.rl_loss import reduce_stats
from miles_lite.types import TrainBatch


def minibatch_plan(num_sequences: int, updates: int, epochs: int, seed: int) -> list[list[int]]:
    """Sequence indices of every optimizer step, in order: `epochs` passes of `updates` mini-batches.

    Each pass is a fresh seeded permutation cut into `min(updates, num_sequences)` near-equal parts, so
    every sequence is trained on once per pass. The seed makes the plan identical on every trainer rank.
    One update and one epoch give the whole batch, in order.
    """
    if updates < 1 or epochs < 1:
        raise ValueError(f"algo.updates_per_rollout={updates} and algo.epochs_per_rollout={epochs} must be >= 1")
    if num_sequences < 1:
        raise ValueError("a rollout batch needs at least one sequence")
    if updates == 1 and epochs == 1:
        return [list(range(num_sequences))]
    parts = min(updates, num_sequences)
    plan: list[list[int]] = []
    for epoch in range(epochs):
        gen = torch.Generator().manual_seed(seed * 1000 + epoch)
        order = torch.randperm(num_sequences, generator=gen)
        plan.extend(chunk.tolist() for chunk in torch.tensor_split(order, parts))
    return plan


def combine_update_stats(per_update: Sequence[dict[str, float]], batch: TrainBatch, seconds: float
                         ) -> dict[str, float]:
    """One stats record for the optimizer steps taken on `batch`.

    Loss, policy, mismatch and entropy stats are the mean over the steps (`*_max` / `*_min`: over all);
    `grad_norm` the mean over the steps that were taken; `skipped` counts skipped steps; `lr` and the
    running totals (`nonfinite_total`, `diverged_total`) are the last step's. Adds `policy/updates`,
    `policy/clip_frac` (low + high) and `policy/ratio_spread` (largest minus smallest ratio seen).
    """
    stats = reduce_stats([(1.0, s) for s in per_update])
    norms = [s["grad_norm"] for s in per_update if math.isfinite(s.get("grad_norm", float("nan")))]
    processed = sum(s.get("tokens", 0.0) for s in per_update)
    stats.update(
        grad_norm=sum(norms) / len(norms) if norms else float("nan"),
        skipped=float(sum(s.get("skipped", 0.0) for s in per_update)),
        lr=per_update[-1]["lr"],
        tokens=float(batch.num_tokens),
        response_tokens=float(sum(batch.response_lengths)),
        loss_tokens=float(sum(batch.loss_token_counts)),
        tokens_per_s=processed / max(seconds, 1e-9),
        step_time_s=seconds,
    )
    for counter in ("nonfinite_total", "diverged_total"):  # running totals: the last step's
        if counter in per_update[-1]:
            stats[counter] = per_update[-1][counter]
    stats["policy/updates"] = float(len(per_update))
    if "policy/clip_frac_low" in stats:
        stats["policy/clip_frac"] = stats["policy/clip_frac_low"] + stats["policy/clip_frac_high"]
        stats["policy/ratio_spread"] = stats["policy/ratio_max"] - stats["policy/ratio_min"]
    return stats
