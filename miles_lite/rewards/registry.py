"""Reward registry, named reward sets and weighted scoring.

A reward function maps a batch of completions to one raw value per completion (or None where it does
not apply), in one of the conventions of `rewards.batch`; the math rewards are::

    fn(completions, *, answers, questions, steps) -> list[float]

A :class:`RewardSet` names rewards and their weights; :func:`score_batch` runs every reward of a
set, checks what each returned, and adds the weighted ``total`` of the values that apply.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, Protocol

from miles_lite.plugins import PluginFailed
from miles_lite.rewards import math as math_rewards
from miles_lite.rewards import records as record_rewards
from miles_lite.rewards.batch import RewardBatch, batch_from_records, call_style, checked_values, with_sample_fields
from miles_lite.rewards.context import RewardContext
from miles_lite.types import Group

TOTAL_KEY = "total"


class RewardFn(Protocol):
    """Batch reward: one raw float per completion; every keyword sequence is aligned with it."""

    def __call__(
        self,
        completions: Sequence[str],
        *,
        answers: Sequence[float],
        questions: Sequence[str],
        steps: Sequence[Sequence[float]],
    ) -> list[float]: ...


# Built-in rewards in reporting order.
REWARD_NAMES: tuple[str, ...] = (
    "exact_check",
    "correctness_check",
    "lenient_correctness_check",
    "format_check",
    "tag_check",
    "step_check",
    "solution_number_check",
)


# Built-in rewards of records: the label, any JSON value, against the completion's answer.
RECORD_REWARD_NAMES: tuple[str, ...] = ("exact_match", "math_answer")


@dataclass(frozen=True)
class RegisteredReward:
    """A registry entry: the reward function, the largest raw value it can return (None: not declared, see
    `rewards.success`), its calling convention (`rewards.batch.STYLES`), for `rewards.by_source` the one data
    source it scores (None: all), and whether it compares the completion with a numeric label
    (`numeric_labels`: the math convention always does)."""

    fn: RewardFn
    max_value: float | None = 1.0
    style: str = "math"
    source: str | None = None
    numeric_labels: bool = False
    # Plug-ins run in a `plugins.PluginPool` (off the caller's thread, processes where configured), each call at
    # most `timeout_s`; None: called in place (the built-in rewards).
    pool: Any = field(default=None, compare=False)
    timeout_s: float | None = None

    @property
    def needs_numbers(self) -> bool:
        """Whether a record whose label is not a number can never score with this reward."""
        return self.style == "math" or self.numeric_labels

    def _call(self, name: str, batch: RewardBatch) -> Any:
        return call_style(self.fn, self.style, batch, self.timeout_s, self.pool, name)

    def values(self, name: str, batch: RewardBatch) -> list[float]:
        """One raw value per completion of `batch`, NaN where it does not apply (other sources, None)."""
        if self.source is None:
            return checked_values(name, self._call(name, batch), len(batch))
        rows = [i for i, source in enumerate(batch.sources) if source == self.source]
        out = [math.nan] * len(batch)
        if rows:
            for i, value in zip(rows, checked_values(name, self._call(name, batch.subset(rows)),
                                                     len(rows)), strict=True):
                out[i] = value
        return out


# Raw maxima of the built-ins; all others reach 1.0.
_BUILTIN_MAX = MappingProxyType({"tag_check": 4 * math_rewards.TAG_CREDIT})
# The one process-wide registry: name -> reward. Custom rewards join it through
# register_reward so that configs can refer to them by name.
REWARD_REGISTRY: dict[str, RegisteredReward] = {
    **{name: RegisteredReward(getattr(math_rewards, name), _BUILTIN_MAX.get(name, 1.0)) for name in REWARD_NAMES},
    "exact_match": RegisteredReward(record_rewards.ExactMatch(), style="batch"),
    "math_answer": RegisteredReward(record_rewards.math_answer, style="batch", numeric_labels=True),
}
BUILTIN_NAMES = (*REWARD_NAMES, *RECORD_REWARD_NAMES)


@dataclass(frozen=True)
class RewardSet:
    """A named, immutable choice of rewards and their weights.

    Attributes:
        name: label used in configs and logs.
        weights: reward name -> weight applied to its raw value in the ``total``.
    """

    name: str
    weights: Mapping[str, float] = field(hash=False)
    # Rewards this set brings along instead of taking them from the registry (plug-ins, a remote
    # reward model): name -> reward. Names here shadow registered ones.
    functions: Mapping[str, RegisteredReward] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        if not self.weights:
            raise ValueError(f"reward set {self.name!r} has no rewards")
        weights = {str(key): float(value) for key, value in self.weights.items()}
        bad = {key: value for key, value in weights.items() if not math.isfinite(value)}
        if bad:
            raise ValueError(f"reward set {self.name!r} has non-finite weights: {bad}")
        if TOTAL_KEY in weights:
            raise ValueError(f"{TOTAL_KEY!r} is reserved for the weighted sum, not a reward name")
        object.__setattr__(self, "weights", MappingProxyType(weights))
        object.__setattr__(self, "functions", MappingProxyType(dict(self.functions)))

    def with_weights(self, overrides: Mapping[str, float]) -> RewardSet:
        """A copy whose weights are these weights updated by ``overrides`` (which may add rewards).

        Raises:
            ValueError: an override names an unregistered reward or a non-finite weight.
        """
        validate_reward_names(overrides, self.functions)
        return RewardSet(self.name, {**self.weights, **overrides}, self.functions)

    def with_reward(self, name: str, reward: RegisteredReward, weight: float) -> RewardSet:
        """A copy that also scores with ``reward`` under ``name`` (carried by the set, not registered)."""
        if name == TOTAL_KEY or not name.strip():
            raise ValueError(f"invalid reward name {name!r}")
        if name in self.weights:
            raise ValueError(f"reward set {self.name!r} already has a reward named {name!r}")
        return RewardSet(self.name, {**self.weights, name: weight}, {**self.functions, name: reward})

    def run_in(self, pool: Any, timeout_s: float | None) -> RewardSet:
        """A copy whose plug-in reward functions (the math and TRL conventions; not the built-in rewards, nor
        the remote reward model, which bounds its own requests) run in `pool` with `timeout_s` per call."""
        functions = {name: replace(self.reward(name), pool=pool, timeout_s=timeout_s) for name in self.names
                     if name not in BUILTIN_NAMES and self.reward(name).style != "batch"}
        return RewardSet(self.name, self.weights, {**self.functions, **functions})

    def reward(self, name: str) -> RegisteredReward:
        """The reward scored under ``name``: the set's own, else the registry's."""
        return self.functions.get(name) or REWARD_REGISTRY[name]

    @property
    def names(self) -> tuple[str, ...]:
        """Reward names in the order they are reported."""
        return tuple(self.weights)

    @property
    def max_total(self) -> float:
        """Highest reachable ``total``: each positive weight times its reward's maximum raw value
        (rewards are assumed non-negative). Rewards must be registered."""
        return self.max_total_for(None, every_source=True)

    def max_total_for(self, source: str | None, every_source: bool = False) -> float:
        """Highest reachable ``total`` of a completion of a record from `source`: the rewards of other
        sources (`rewards.by_source`) do not apply to it (`every_source`: count them all). A reward without a
        declared maximum counts 1.0 here; whether a completion is right is `rewards.success`'s question."""
        validate_reward_names(self.names, self.functions)
        return sum(max(weight, 0.0) * _nominal(self.reward(name).max_value) for name, weight in self.weights.items()
                   if every_source or self.reward(name).source in (None, source))


def _nominal(max_value: float | None) -> float:
    return 1.0 if max_value is None else max_value


WORKLOG_WEIGHTS = {
    "exact_check": 2.0,
    "correctness_check": 1.0,
    "lenient_correctness_check": 0.5,
    "format_check": 0.5,
    "tag_check": 1.0,
    "step_check": 0.5,
    "solution_number_check": 0.25,
}
REWARD_SETS: Mapping[str, RewardSet] = MappingProxyType(
    {
        # Everything: correctness dominates, format and shown work shape early training.
        "worklog": RewardSet("worklog", WORKLOG_WEIGHTS),
        "correctness_only": RewardSet("correctness_only", {"correctness_check": 1.0}),
        # Only the shape of the answer, with the worklog weights (max 1.25).
        "format_only": RewardSet(
            "format_only", {"format_check": 0.5, "tag_check": 1.0, "solution_number_check": 0.25}
        ),
        # Records: the final answer equals the label (any JSON value), or the boxed/tagged number equals it.
        "exact_match": RewardSet("exact_match", {"exact_match": 1.0}),
        "math_answer": RewardSet("math_answer", {"math_answer": 1.0}),
    }
)


def get_reward_set(name: str | RewardSet) -> RewardSet:
    """The named reward set (a :class:`RewardSet` passes through unchanged).

    Raises:
        ValueError: unknown name; the message lists the known sets.
    """
    if isinstance(name, RewardSet):
        return name
    if name not in REWARD_SETS:
        raise ValueError(f"unknown reward set {name!r}; known sets: {', '.join(sorted(REWARD_SETS))}")
    return REWARD_SETS[name]


def validate_reward_names(names: Iterable[str], extra: Mapping[str, object] = MappingProxyType({})) -> None:
    """Check that every name is a registered reward (or one of ``extra``'s names).

    Raises:
        ValueError: listing the unknown names and the known reward names.
    """
    unknown = [name for name in names if name not in REWARD_REGISTRY and name not in extra]
    if unknown:
        known = sorted({*REWARD_REGISTRY, *extra})
        raise ValueError(f"unknown reward name(s) {unknown}; known rewards: {', '.join(known)}")


def register_reward(name: str, fn: RewardFn, *, max_value: float = 1.0) -> None:
    """Add a custom reward under ``name`` so reward sets can use it.

    ``max_value`` is the largest raw value ``fn`` returns; it only feeds
    :attr:`RewardSet.max_total` (used to normalise and report rewards).

    Raises:
        ValueError: the name is empty, reserved (``total``) or already registered, or
            ``max_value`` is not a positive finite number.
        TypeError: ``fn`` is not callable.
    """
    if not isinstance(name, str) or not name.strip() or name == TOTAL_KEY:
        raise ValueError(f"invalid reward name {name!r}")
    if name in REWARD_REGISTRY:
        raise ValueError(f"reward {name!r} is already registered")
    if not callable(fn):
        raise TypeError(f"reward {name!r} must be callable, got {type(fn).__name__}")
    if not (math.isfinite(max_value) and max_value > 0):
        raise ValueError(f"reward {name!r}: max_value must be positive and finite, got {max_value!r}")
    REWARD_REGISTRY[name] = RegisteredReward(fn, float(max_value))


def unregister_reward(name: str) -> None:
    """Remove a custom reward; built-in rewards cannot be removed.

    Raises:
        ValueError: ``name`` is built in or not registered.
    """
    if name in BUILTIN_NAMES:
        raise ValueError(f"built-in reward {name!r} cannot be unregistered")
    if name not in REWARD_REGISTRY:
        raise ValueError(f"reward {name!r} is not registered")
    del REWARD_REGISTRY[name]


def score(
    reward_set: RewardSet | str,
    completions: Sequence[str],
    answers: Sequence[float],
    questions: Sequence[str],
    steps: Sequence[Sequence[float]],
) -> list[dict[str, float]]:
    """Score completions of math problems (reference data aligned with ``completions``); see
    :func:`score_batch`.

    Raises:
        ValueError: unknown reward set or reward names, misaligned inputs, or a built-in reward that did
            not return exactly one finite float (or None) per completion (the message names the reward).
        PluginFailed: a plug-in reward (a function, a `RewardSet`'s own, the remote reward model) raised
            or did not return one finite float (or None) per completion.
    """
    return score_batch(reward_set, RewardBatch(list(completions), list(answers), list(questions),
                                               [tuple(s) for s in steps]))


def _reward_values(reward_set: RewardSet, name: str, batch: RewardBatch) -> list[float]:
    """One reward's checked values; a plug-in reward (anything but the built-in ones) that raises or returns
    unusable values raises `PluginFailed` naming it."""
    try:
        return reward_set.reward(name).values(name, batch)
    except Exception as exc:
        if name in BUILTIN_NAMES and name not in reward_set.functions:
            raise
        raise PluginFailed(f"reward {name!r}", exc) from exc


def score_batch(reward_set: RewardSet | str, batch: RewardBatch) -> list[dict[str, float]]:
    """Score every completion of `batch` with every reward of ``reward_set``.

    Returns one dict per completion: each reward's raw value under its name (NaN where the reward does
    not apply: it returned None, or it scores another data source), plus ``total``, the weighted sum of
    the values that apply (0.0 when none does).

    Raises:
        PluginFailed: see :func:`score`.
    """
    reward_set = get_reward_set(reward_set)
    validate_reward_names(reward_set.names, reward_set.functions)
    raw = {name: _reward_values(reward_set, name, batch) for name in reward_set.names}
    results = []
    for index in range(len(batch)):
        row = {name: raw[name][index] for name in reward_set.names}
        row[TOTAL_KEY] = sum(reward_set.weights[name] * value for name, value in row.items() if not math.isnan(value))
        results.append(row)
    return results


def score_groups(reward_set: RewardSet | str, groups: Sequence[Group],
                 context: RewardContext | None = None) -> list[Group]:
    """Fill every sample's `rewards` (each reward's raw value and the weighted `total`) and `extra` (what the
    plug-ins logged for it with `log_extra`); returns `groups`.

    Groups that carry their record hand its label, source and columns to the rewards. `context`: the trainer
    state the plug-ins see and where their `log_metric` values go (None: a fresh one, values dropped)."""
    context = (context if context is not None else RewardContext()).for_batch()
    samples = [(g, s) for g in groups for s in g.samples]
    completions = [s.response_text for _, s in samples]
    if samples and all(g.record is not None for g, _ in samples):
        batch = batch_from_records(completions, [g.record for g, _ in samples], [s.response_ids for _, s in samples],
                                   context)
    else:
        batch = RewardBatch(completions, [g.answer for g, _ in samples], [g.question for g, _ in samples],
                            [tuple(g.steps) for g, _ in samples], completion_ids=[s.response_ids for _, s in samples],
                            context=context)
    batch = with_sample_fields(batch, [s.agent for _, s in samples])
    for row, ((_, sample), values) in enumerate(zip(samples, score_batch(reward_set, batch), strict=True)):
        sample.rewards = values
        logged = {column: rows[row] for column, rows in context.extras.items() if row in rows}
        if logged:
            sample.extra = {**sample.extra, **logged}
    return list(groups)
