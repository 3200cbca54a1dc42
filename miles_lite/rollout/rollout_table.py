"""The rollout-table record: one row per completion, with its prompt, text, rewards and provenance.

Field names match the Parquet schema of `miles_lite.observability.rollout_table` (which writes the
rows, one file per step), so a row can be written column by column with `getattr(row, name)`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from miles_lite.types import Group, Sample


@dataclass(frozen=True)
class RolloutRow:
    """One completion of one prompt at one training step.

    - `total`: the weighted reward; `rewards`: every reward's raw value (without "total").
    - `length`: response tokens; `mean_logprob`: mean engine logprob per response token (nats),
      NaN for an empty response.
    - `engine`, `weight_version`: who produced the tokens and under which weights; a completion
      resumed after a weight update reads "3+4" (tokens from mixed versions).
    """

    step: int
    prompt_index: int
    sample_index: int
    prompt: str
    completion: str
    total: float
    finish_reason: str
    length: int
    mean_logprob: float
    engine: str
    weight_version: str
    rewards: dict[str, float] = field(default_factory=dict)


def mean_logprob(sample: Sample) -> float:
    """Mean of the sample's per-token rollout logprobs (nats); NaN for an empty response."""
    lps = sample.rollout_logprobs
    return math.fsum(lps) / len(lps) if lps else math.nan


def rows_from_groups(step: int, groups: Sequence[Group]) -> list[RolloutRow]:
    """One row per sample of every group, in group then sample order."""
    rows = []
    for group in groups:
        for j, sample in enumerate(group.samples):
            rows.append(RolloutRow(
                step=step,
                prompt_index=group.prompt_index,
                sample_index=j,
                prompt=group.prompt_text,
                completion=sample.response_text,
                total=float(sample.reward),
                finish_reason=sample.finish_reason,
                length=len(sample.response_ids),
                mean_logprob=mean_logprob(sample),
                engine=sample.engine_id,
                weight_version=sample.weight_version,
                rewards={k: float(v) for k, v in sample.rewards.items() if k != "total"},
            ))
    return rows
