"""The records of one `RolloutManager.generate_groups` call: slots, pending groups, states and stats."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from miles_lite.rollout.prompt_spec import PromptSpec
from miles_lite.types import Generation, Sample, SamplingParams

# Joins the weight versions (and engine ids) that produced one completion's tokens.
MIXED_SEPARATOR = "+"


class ManagerState(enum.Enum):
    IDLE = "idle"
    RUNNING = "running"
    ABORTING = "aborting"


class RolloutError(RuntimeError):
    """A completion could not be produced within the retry budget."""


AGENT_COUNTERS = ("agents_started", "agents_succeeded", "agents_failed", "agents_timed_out", "agent_turns",
                  "tito_mismatch", "session_engine_moves", "session_diverged", "session_branches")


@dataclass
class RolloutStats:
    """What one `generate_groups` call did. Times in seconds, tokens counted as generated ids."""

    requests: int = 0
    tokens_generated: int = 0
    wall_s: float = 0.0
    latencies_s: list[float] = field(default_factory=list)
    retries: int = 0
    engines_used: dict[str, int] = field(default_factory=dict)
    sampling_rounds: int = 0
    dropped_groups: int = 0
    refill_prompts: int = 0
    resumed_partials: int = 0
    aborted: bool = False
    carried_groups: int = 0
    # Agent slots (`rollout.agent`): agents run, returned a sample, raised, timed out; model turns of the
    # samples; and their sessions' counts (see `rollout/gateway/session.py`).
    agents_started: int = 0
    agents_succeeded: int = 0
    agents_failed: int = 0
    agents_timed_out: int = 0
    agent_turns: int = 0
    tito_mismatch: int = 0
    session_engine_moves: int = 0
    session_diverged: int = 0
    session_branches: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_generated / self.wall_s if self.wall_s > 0 else 0.0

    def as_dict(self) -> dict[str, float]:
        """Scalar summary for metrics (latency as mean and max)."""
        lat = self.latencies_s
        return {
            "requests": float(self.requests),
            "tokens_generated": float(self.tokens_generated),
            "tokens_per_s": self.tokens_per_s,
            "wall_s": self.wall_s,
            "latency_mean_s": sum(lat) / len(lat) if lat else 0.0,
            "latency_max_s": max(lat, default=0.0),
            "retries": float(self.retries),
            "engines_used": float(len(self.engines_used)),
            "sampling_rounds": float(self.sampling_rounds),
            "dropped_groups": float(self.dropped_groups),
            "refill_prompts": float(self.refill_prompts),
            "resumed_partials": float(self.resumed_partials),
            "aborted": float(self.aborted),
            "carried_groups": float(self.carried_groups),
            **{name: float(getattr(self, name)) for name in AGENT_COUNTERS},
        }


@dataclass
class Slot:
    """One completion being produced: tokens so far and where they came from."""

    sample_index: int
    seed: int | None
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[str] = field(default_factory=list)
    engines: list[str] = field(default_factory=list)
    failed_on: set[str] = field(default_factory=set)
    failures: int = 0
    finish_reason: str = ""
    done: bool = False
    in_request: bool = False
    # 1 for tokens the model sampled, 0 for environment replies (multi-turn): the loss mask.
    loss_mask: list[int] = field(default_factory=list)
    # Model turns finished so far, and where the current one starts in `response_ids`.
    turns: int = 0
    turn_start: int = 0
    # The trajectory's own environment, from the environment's `reset(record)` (multi-turn; None: not yet).
    env: Any = None
    # The latest answer's routed expert ids (flat int32, MoE): they cover every position up to its last token.
    routed: Any = None
    # Agent slots: the session's prompt ids (the agent wrote the prompt), what the agent returned, and whether
    # the slot was dropped (the agent failed: no sample).
    prompt_ids: list[int] | None = None
    agent: dict[str, Any] | None = None
    dropped: bool = False

    def append(self, gen: Generation) -> None:
        self.routed = gen.routed_experts
        self.response_ids.extend(gen.output_ids)
        self.logprobs.extend(gen.output_logprobs)
        self.loss_mask.extend([1] * len(gen.output_ids))
        self.versions.append(gen.weight_version)
        self.engines.append(gen.engine_id)
        self.finish_reason = gen.finish_reason

    def append_environment(self, ids: Sequence[int]) -> None:
        """An environment reply: tokens the model continues from, with no log-probability and no loss."""
        self.response_ids.extend(ids)
        self.logprobs.extend([0.0] * len(ids))
        self.loss_mask.extend([0] * len(ids))
        self.turn_start = len(self.response_ids)


@dataclass
class PendingGroup:
    spec: PromptSpec
    sampling: SamplingParams
    slots: list[Slot]

    @property
    def complete(self) -> bool:
        return all(s.done for s in self.slots)


def joined(values: Sequence[str]) -> str:
    return MIXED_SEPARATOR.join(dict.fromkeys(v for v in values if v))


def is_mixed_version(sample: Sample) -> bool:
    """Whether a completion's tokens came from more than one weight version (a resumed partial)."""
    return MIXED_SEPARATOR in sample.weight_version


def slot_seed(base: int | None, prompt_index: int, sample_index: int) -> int | None:
    # Distinct seeds per sample, else every sample of a seeded group would be identical.
    if base is None:
        return None
    return (base * 1_000_003 + prompt_index * 10_007 + sample_index) % (2**31 - 1)
