"""Named evaluation sets: k samples of every prompt with the set's own sampling, scored by the run's
reward set. A sample is correct when its total reward reaches the set's threshold, by default the reward
set's best (`rewards.success`: each reward's declared maximum, or the best it reached over the set's
samples of that source). Each set reports, as `eval/<set>/<measure>`:

- `reward_mean`: the mean total reward over every sample;
- `avg@<k>`: the mean share of correct samples per prompt;
- `pass@<j>` for j = 1 and k (and the powers of two between): the unbiased estimator of Chen et al.
  (2021) from the k samples of each prompt, averaged over prompts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from miles_lite.data.problems import EvalSet
from miles_lite.rewards import RewardSet, score_groups
from miles_lite.rewards.context import RewardContext
from miles_lite.rewards.success import right_flags
from miles_lite.rollout.presample import pass_at_k
from miles_lite.types import Group, SamplingParams


@dataclass(frozen=True)
class SetResult:
    """One evaluation of one set."""

    name: str
    n: int
    k: int
    reward_mean: float
    avg_at_k: float
    pass_at: dict[int, float] = field(default_factory=dict)
    # What the set's size left out of its file (`EvalSet.cut`); None: the whole file.
    cut: str | None = None

    def stats(self) -> dict[str, float]:
        """The `eval/<set>/<measure>` entries of metrics.jsonl, Prometheus and the summary."""
        prefix = f"eval/{self.name}/"
        return {f"{prefix}reward_mean": self.reward_mean, f"{prefix}avg@{self.k}": self.avg_at_k,
                **{f"{prefix}pass@{j}": v for j, v in self.pass_at.items()}}

    def table(self, title: str) -> str:
        cut = f"; {self.cut}" if self.cut else ""
        lines = [f"{title}: set {self.name!r} ({self.n} prompts, k={self.k}{cut})",
                 f"  {'mean reward':<20}{self.reward_mean:8.3f}",
                 f"  {f'avg@{self.k}':<20}{self.avg_at_k * 100:7.1f}%"]
        lines += [f"  {f'pass@{j}':<20}{v * 100:7.1f}%" for j, v in self.pass_at.items()]
        return "\n".join(lines)


def pass_points(k: int) -> list[int]:
    """1, the powers of two below k, and k."""
    points = [1]
    while points[-1] * 2 < k:
        points.append(points[-1] * 2)
    return sorted({*points, k})


def set_sampling(base: SamplingParams, eval_set: EvalSet) -> SamplingParams:
    """The run's sampling (`base`) with the set's temperature (unset: greedy for k = 1, the run's for k > 1),
    top-p and token budget (unset: the run's)."""
    cfg = eval_set.cfg
    return replace(base, temperature=cfg.sampling_temperature(base.temperature),
                   top_p=cfg.top_p if cfg.top_p is not None else base.top_p, top_k=-1,
                   max_new_tokens=cfg.max_new_tokens or base.max_new_tokens)


def summarise_set(name: str, groups: Sequence[Group], k: int, reward_set: RewardSet,
                  threshold: float | None) -> SetResult:
    """Mean reward, avg@k and pass@j of scored groups (k samples each)."""
    rewards = [s.reward for g in groups for s in g.samples]
    right = iter(right_flags(reward_set, [s.rewards for g in groups for s in g.samples],
                             [g.source for g in groups for _ in g.samples], threshold))
    correct = [sum(next(right) for _ in group.samples) for group in groups]
    n = max(len(groups), 1)
    return SetResult(name, len(groups), k, sum(rewards) / max(len(rewards), 1), sum(c / k for c in correct) / n,
                     {j: sum(pass_at_k(k, c, j) for c in correct) / n for j in pass_points(k)})


def evaluate_set(manager: Any, eval_set: EvalSet, encoder: Any, sampling: SamplingParams,
                 reward_set: RewardSet, context: RewardContext | None = None) -> SetResult:
    """Sample `k` completions of every prompt of the set through the engines and score them (`context`: the
    trainer state reward plug-ins see)."""
    specs = encoder.prompt_specs(list(enumerate(eval_set.items)))
    groups: list[Group] = manager.generate_groups(specs, eval_set.cfg.k, set_sampling(sampling, eval_set))
    if len(groups) != len(specs):
        raise RuntimeError(f"evaluation set {eval_set.name!r} got {len(groups)} groups for {len(specs)} prompts")
    score_groups(reward_set, groups, context)
    result = replace(summarise_set(eval_set.name, groups, eval_set.cfg.k, reward_set, eval_set.cfg.threshold),
                     cut=eval_set.cut)
    assert all(math.isfinite(v) for v in result.stats().values())
    return result
