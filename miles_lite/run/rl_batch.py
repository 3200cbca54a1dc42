"""From scored groups to the trainer's batch: staleness filter, advantages, zero-signal accounting, reward
statistics, and the distillation batch of the on-policy-distillation warm-up."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from miles_lite.algo.advantages import compute_advantages, ragged_advantages
from miles_lite.config.schema import AlgoConfig, MilesConfig
from miles_lite.data.calculator import call_outcomes
from miles_lite.plugins import PluginFailed
from miles_lite.rewards.success import right_flags
from miles_lite.rollout.manager import MIXED_SEPARATOR
from miles_lite.types import Group, Sample, TrainBatch


def oldest_version(sample: Sample) -> int | None:
    """The oldest weight version that wrote any of the sample's tokens ("3+4" -> 3).

    Versions are the driver's push numbers; None when any part is not one (e.g. an engine still
    serving weights this run never pushed, which reports "default" or ""), since its lag is unknown.
    """
    parts = sample.weight_version.split(MIXED_SEPARATOR) if sample.weight_version else []
    if not parts or not all(p.isdigit() for p in parts):
        return None
    return min(int(p) for p in parts)


def drop_stale(groups: Sequence[Group], current_version: int, max_staleness: int
               ) -> tuple[list[Group], dict[str, float]]:
    """Keep groups whose oldest token was written at most `max_staleness` versions before `current_version`.

    `current_version` is the version of the trainer's weights now (the last push). A group is judged by
    its oldest sample, as its advantages share one baseline. Returns the kept groups and stats:
    `rollout/stale_dropped` (groups), `rollout/mixed_version_samples`, `rollout/staleness_mean` and
    `rollout/staleness_max` (versions behind, over samples with a known version), and the distribution:
    `rollout/staleness_samples/<lag>` samples `lag` versions behind (kept or not), for each lag seen.
    """
    if max_staleness < 0:
        raise ValueError(f"rollout.max_staleness must be >= 0, got {max_staleness}")
    kept: list[Group] = []
    lags: list[int] = []
    mixed = 0
    for group in groups:
        versions = [oldest_version(s) for s in group.samples]
        mixed += sum(1 for s in group.samples if MIXED_SEPARATOR in s.weight_version)
        known = [current_version - v for v in versions if v is not None]
        lags.extend(known)
        if len(known) == len(versions) and max(known, default=0) <= max_staleness:
            kept.append(group)
    stats = {"rollout/stale_dropped": float(len(groups) - len(kept)),
             "rollout/mixed_version_samples": float(mixed),
             "rollout/staleness_mean": sum(lags) / len(lags) if lags else 0.0,
             "rollout/staleness_max": float(max(lags, default=0))}
    for lag in sorted(set(lags)):
        stats[f"rollout/staleness_samples/{lag}"] = float(lags.count(lag))
    return kept, stats


def rl_distill_coef(cfg: MilesConfig) -> float:
    """The distillation weight of RL steps: `algo.rl_distill_coef` if set; else 0 after an OPD warm-up
    (whose steps used `algo.distill_coef`), else `algo.distill_coef`."""
    if cfg.algo.rl_distill_coef is not None:
        return cfg.algo.rl_distill_coef
    return 0.0 if cfg.experiment.warmup == "opd" else cfg.algo.distill_coef


def reward_stats(groups: Sequence[Group], reward_set: Any = None) -> dict[str, object]:
    """Reward mean/std, the task's accuracy and per-reward value lists over every sample.

    Accuracy: with the math rewards, `reward/exact_accuracy` (the exact answer-and-format share); with any
    other reward set (records tasks, `rewards.set=math_answer`), given `reward_set`, `reward/accuracy`: the
    share of samples whose total reaches the most the set can give a record of their source (what makes an
    evaluation set's sample correct). With data sources, `reward/mean/<source>` and `reward/accuracy/<source>`
    per source.

    A reward that does not apply to a sample (None, or another data source's reward: NaN in `rewards`)
    is left out of that reward's values and counted in `reward/none/<name>`; `reward/mean` and
    `reward/std` leave out the samples no reward applies to (counted in `reward/unscored_samples`)."""
    every = [s for g in groups for s in g.samples]
    names = sorted({k for s in every for k in s.rewards if k != "total"})
    scored = [s for s in every if not names or any(not math.isnan(s.rewards.get(n, 0.0)) for n in names)]
    totals = torch.tensor([s.reward for s in scored], dtype=torch.float64)
    stats: dict[str, object] = {
        "reward/mean": float(totals.mean()) if len(scored) else 0.0,
        "reward/std": float(totals.std(unbiased=False)) if len(scored) else 0.0,
        "rollout/response_length_mean": (sum(len(s.response_ids) for s in every) / len(every)) if every else 0.0,
    }
    if not every or "exact_check" in names:  # the math rewards' exact answer-and-format share
        stats["reward/exact_accuracy"] = (sum(s.rewards.get("exact_check", 0.0) for s in every) / len(every)
                                          if every else 0.0)
    elif reward_set is not None:
        stats.update(task_accuracy(groups, reward_set))
    for name in names:
        values = [s.rewards.get(name, 0.0) for s in every]
        stats[f"reward/values/{name}"] = [v for v in values if not math.isnan(v)]
        nones = sum(math.isnan(v) for v in values)
        if nones:
            stats[f"reward/none/{name}"] = float(nones)
    if len(scored) < len(every):
        stats["reward/unscored_samples"] = float(len(every) - len(scored))
    return stats


def require_scored(groups: Sequence[Group]) -> None:
    """Raise `PluginFailed` when no reward gave a value for any completion of a step (every reward returned
    None for every completion): every total would be 0, so the step would train on nothing, and so would the
    run's every later step while the reward keeps not applying; it names the rewards and the fix."""
    every = [s for g in groups for s in g.samples]
    names = sorted({k for s in every for k in s.rewards if k != "total"})
    if not every or any(not math.isnan(s.rewards.get(n, math.nan)) for s in every for n in names):
        return
    plugin = f"reward {names[0]!r}" if len(names) == 1 else "rewards " + ", ".join(repr(n) for n in names)
    raise PluginFailed(plugin, ValueError(
        f"returned None for all {len(every)} completions of the step: none was scored, so there is nothing to learn "
        "from; return a float for every completion a reward applies to (None only where it does not apply)"))


def task_accuracy(groups: Sequence[Group], reward_set: Any) -> dict[str, float]:
    """`reward/accuracy` over every sample, and `reward/accuracy/<source>`, `reward/mean/<source>` per data source.
    A sample is right when it reached the reward set's best (`rewards.success`, over the step's samples)."""
    samples = [(group.source, sample) for group in groups for sample in group.samples]
    flags = right_flags(reward_set, [s.rewards for _, s in samples], [source for source, _ in samples])
    right: dict[str | None, list[float]] = {}
    totals: dict[str | None, list[float]] = {}
    for (source, sample), ok in zip(samples, flags, strict=True):
        right.setdefault(source, []).append(float(ok))
        totals.setdefault(source, []).append(sample.reward)
    every = [r for values in right.values() for r in values]
    stats = {"reward/accuracy": sum(every) / len(every) if every else 0.0}
    for source in sorted(s for s in right if s is not None):
        stats[f"reward/accuracy/{source}"] = sum(right[source]) / len(right[source])
        stats[f"reward/mean/{source}"] = sum(totals[source]) / len(totals[source])
    return stats


def tool_stats(groups: Sequence[Group]) -> dict[str, float]:
    """Tool use of a multi-turn step: environment replies per trajectory, the share of trajectories with
    at least one, and (for replies in the calculator's `<result>` format) the share of calls whose value
    is an intermediate result of the reference solution."""
    calls, answered, right = [], 0, 0
    for group in groups:
        for sample in group.samples:
            calls.append(sample.environment_replies)
            n, ok = call_outcomes(sample.response_text, group.steps)
            answered, right = answered + n, right + ok
    if not calls:
        return {}
    stats = {"rollout/tool_calls_per_sample": sum(calls) / len(calls),
             "rollout/tool_use_share": sum(c > 0 for c in calls) / len(calls)}
    if answered:
        stats["rollout/tool_correct_call_share"] = right / answered
    return stats


def build_train_batch(groups: Sequence[Group], algo: AlgoConfig) -> tuple[TrainBatch | None, dict[str, float]]:
    """Advantages per completion (the group is its own baseline) and the ragged `TrainBatch`.

    Zero-signal groups (all rewards equal) are always counted; with `algo.drop_zero_signal` they are
    left out of the batch. Returns `(None, stats)` when nothing is left to train on (also for no groups).
    """
    if not groups:
        return None, {"algo/zero_signal_share": 0.0, "algo/zero_signal_groups": 0.0, "algo/groups": 0.0,
                      "algo/trained_sequences": 0.0}
    advantages, zero, keep = _advantages(groups, algo)
    stats = {"algo/zero_signal_share": sum(zero) / len(zero) if zero else 0.0,
             "algo/zero_signal_groups": float(sum(zero)),
             "algo/groups": float(len(groups))}
    samples = [s for g in groups for s in g.samples]
    chosen = [i for i in range(len(samples)) if keep[i] and samples[i].response_ids]
    stats["algo/trained_sequences"] = float(len(chosen))
    if not chosen:
        return None, stats
    batch = TrainBatch(
        tokens=[samples[i].prompt_ids + samples[i].response_ids for i in chosen],
        prompt_lengths=[len(samples[i].prompt_ids) for i in chosen],
        rollout_logprobs=[list(samples[i].rollout_logprobs) for i in chosen],
        advantages=[advantages[i] for i in chosen],
        loss_masks=_loss_masks([samples[i] for i in chosen]),
        routed_experts=_routed([samples[i] for i in chosen]),
    )
    return batch, stats


def _advantages(groups: Sequence[Group], algo: AlgoConfig) -> tuple[list[float], list[bool], list[bool]]:
    """Per-sample advantages, per-group zero-signal flags and per-sample keep flags. Groups are `group_size`
    samples each, except where an agent's sample was dropped (`rollout.agent`): then the estimator runs on the
    ragged groups (`ragged_advantages`)."""
    sizes = {len(g.samples) for g in groups}
    if len(sizes) == 1 and min(sizes) > 0:
        rewards = torch.tensor([s.reward for g in groups for s in g.samples], dtype=torch.float64)
        result = compute_advantages(rewards, sizes.pop(), algo.advantage_estimator, std_normalize=algo.std_normalize)
        keep = result.keep_mask if algo.drop_zero_signal else torch.ones_like(result.keep_mask)
        return result.advantages.tolist(), result.zero_signal_mask.tolist(), keep.tolist()
    nonempty = [g for g in groups if g.samples]
    advantages, zero = ragged_advantages([[s.reward for s in g.samples] for g in nonempty], algo.advantage_estimator,
                                         std_normalize=algo.std_normalize)
    keep = [not (algo.drop_zero_signal and z) for g, z in zip(nonempty, zero, strict=True) for _ in g.samples]
    return advantages, zero, keep


def _routed(samples: Sequence[Sample]) -> list[Any] | None:
    """The samples' routed expert ids (MoE rollouts), None when no sample carries them."""
    routed = [s.routed_experts for s in samples]
    return routed if any(r is not None for r in routed) else None


def _loss_masks(samples: Sequence[Sample]) -> list[list[int]] | None:
    """Per-sample loss masks when any sample has environment tokens (multi-turn), else None."""
    if all(s.loss_mask is None for s in samples):
        return None
    return [list(s.loss_mask) if s.loss_mask is not None else [1] * len(s.response_ids) for s in samples]


def distill_batch(groups: Sequence[Group]) -> TrainBatch | None:
    """Every non-empty completion with a zero advantage: the batch of an on-policy-distillation step.

    The policy term then has no gradient and the student learns only from the distillation term
    (`algo.distill_coef`), whose per-token reward is teacher minus student log-prob. None when every
    completion is empty.
    """
    samples = [s for g in groups for s in g.samples if s.response_ids]
    if not samples:
        return None
    return TrainBatch(tokens=[s.prompt_ids + s.response_ids for s in samples],
                      prompt_lengths=[len(s.prompt_ids) for s in samples],
                      rollout_logprobs=[list(s.rollout_logprobs) for s in samples],
                      advantages=[0.0] * len(samples), loss_masks=_loss_masks(samples),
                      routed_experts=_routed(samples))


def rollout_stats(stats: Any) -> dict[str, object]:
    """The rollout manager's per-call stats under the metric keys the registry knows (the agent slots' when an
    agent ran)."""
    agents = {} if not stats.agents_started else {
        "rollout/agents_started": float(stats.agents_started),
        "rollout/agents_failed": float(stats.agents_failed),
        "rollout/agent_timeouts": float(stats.agents_timed_out),
        "rollout/agent_turns_per_sample": stats.agent_turns / max(stats.agents_succeeded, 1),
        "rollout/tito_mismatch": float(stats.tito_mismatch),
        "rollout/session_engine_moves": float(stats.session_engine_moves),
        "rollout/session_diverged": float(stats.session_diverged),
        "rollout/session_branches": float(stats.session_branches),
    }
    return {
        **agents,
        "rollout/tokens_per_second": stats.tokens_per_s,
        "rollout/generated_tokens": float(stats.tokens_generated),
        "rollout/request_latency_seconds": list(stats.latencies_s),
        "rollout/retried_requests": float(stats.retries),
        "rollout/dynamic_sampling_rounds": float(stats.sampling_rounds),
        "rollout/dropped_groups": float(stats.dropped_groups),
        "rollout/refill_prompts": float(stats.refill_prompts),
        "rollout/wall_seconds": stats.wall_s,
        "rollout/resumed_partials": float(stats.resumed_partials),
    }
