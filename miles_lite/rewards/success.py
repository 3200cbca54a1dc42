"""When a scored completion counts as right (evaluation sets, presampling records): it reached the reward set's
best, reward by reward.

A completion is right when its total reaches the sum, over the rewards that apply to it (not None, not another
source's), of weight x that reward's best value. A reward's best value is its declared maximum (`max_value`:
the built-ins, the remote reward model's `max_score`, a plug-in's `max_value` attribute or its
`rewards.custom` entry's `max_value`); a reward without one is judged by the best value it reached over the
group scored together (an evaluation set's completions of the same data source, a presample group's k
completions), so a penalty whose best is 0 (an overlong or repetition penalty) counts 0 as reached. With a
negative weight the best is the lowest value. A completion no reward applies to is not right.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from miles_lite.rewards.registry import TOTAL_KEY, RewardSet

# Right: total >= bar - TOLERANCE (the total is a float sum of weighted rewards).
TOLERANCE = 1e-9


def _observed_best(reward_set: RewardSet, rows: Sequence[Mapping[str, float]], sources: Sequence[str | None]
                   ) -> dict[tuple[str, str | None], float]:
    """(reward, source) -> the best value the reward reached on that source's rows (by its weight's sign)."""
    best: dict[tuple[str, str | None], float] = {}
    for row, source in zip(rows, sources, strict=True):
        for name, weight in reward_set.weights.items():
            value = row.get(name, math.nan)
            if math.isnan(value):
                continue
            key = (name, source)
            if key not in best:
                best[key] = value
            else:
                best[key] = max(best[key], value) if weight >= 0 else min(best[key], value)
    return best


def success_bars(reward_set: RewardSet, rows: Sequence[Mapping[str, float]], sources: Sequence[str | None]
                 ) -> list[float]:
    """The total each row (a completion's reward values) must reach to be right; NaN where no reward applies."""
    observed = _observed_best(reward_set, rows, sources)
    bars = []
    for row, source in zip(rows, sources, strict=True):
        bar, applies = 0.0, False
        for name, weight in reward_set.weights.items():
            if math.isnan(row.get(name, math.nan)):
                continue
            applies = True
            declared = reward_set.reward(name).max_value
            best = declared if declared is not None and weight >= 0 else observed[(name, source)]
            bar += weight * best
        bars.append(bar if applies else math.nan)
    return bars


def right_flags(reward_set: RewardSet, rows: Sequence[Mapping[str, float]], sources: Sequence[str | None],
                threshold: float | None = None) -> list[bool]:
    """Whether each row is right: its total reaches `threshold` when given, else its `success_bars` bar."""
    if threshold is not None:
        return [row.get(TOTAL_KEY, 0.0) >= threshold - TOLERANCE for row in rows]
    return [not math.isnan(bar) and row.get(TOTAL_KEY, 0.0) >= bar - TOLERANCE
            for row, bar in zip(rows, success_bars(reward_set, rows, sources), strict=True)]
