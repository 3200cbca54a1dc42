"""The reward an agent plug-in returns (`rollout.agent`): its result's `reward` field, which reaches the rewards
as the column `reward` of its sample (every field the agent returns is a column by its own name). Scored as
the reward `agent` (weight 1.0 unless `rewards.weights.agent` says otherwise; its largest value is taken to be
1.0, which evaluation sets use as the bar of a correct sample unless their `threshold` is set)."""

from __future__ import annotations

import math
from typing import Any

from miles_lite.rewards.batch import RewardBatch

AGENT_REWARD = "agent"


def agent_reward(batch: RewardBatch) -> list[float | None]:
    """The `reward` each sample's agent returned; None where it returned none (or a failed agent)."""
    values: list[Any] = batch.columns.get("reward") or [None] * len(batch)
    out: list[float | None] = []
    for i, value in enumerate(values):
        if value is None:
            out.append(None)
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise ValueError(f"the agent of completion {i} returned reward={value!r}; return a finite number or "
                             "leave `reward` out")
        out.append(float(value))
    return out
