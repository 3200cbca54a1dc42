"""Rewards for tagged math completions, reward sets and batch scoring. A library: it may import `formats`,
`plugins` and the shared types, nothing above them.
"""

from __future__ import annotations

from collections.abc import Sequence

from miles_lite.formats.answer import (
    answer_matches,
    find_numbers,
    numbers_equal,
    parse_final_answer,
    parse_number,
    parse_solution_number,
)
from miles_lite.rewards.registry import (
    REWARD_NAMES,
    REWARD_SETS,
    RewardFn,
    RewardSet,
    get_reward_set,
    register_reward,
    score,
    score_groups,
    unregister_reward,
    validate_reward_names,
)

__all__ = [
    "REWARD_NAMES",
    "REWARD_SETS",
    "RewardFn",
    "RewardSet",
    "answer_matches",
    "find_numbers",
    "get_reward_set",
    "numbers_equal",
    "parse_answer",
    "parse_number",
    "parse_solution_number",
    "register_reward",
    "score",
    "score_groups",
    "score_completions",
    "unregister_reward",
    "validate_reward_names",
]


def parse_answer(answer: float | int | str) -> float:
    """Reference answer as a float.

    Numbers pass through; a string is either a number (``"1,234"``) or a full GSM8K reference
    solution, whose answer is read from its ``#### N`` line (tags in it are ignored).

    Raises:
        ValueError: a string that is neither.
    """
    if isinstance(answer, str):
        if "####" in answer:
            return parse_final_answer(answer, where="reference answer")
        value = parse_number(answer)
        if value is None:
            raise ValueError(f"reference answer {answer!r} is not a number and has no '#### N' line")
        return value
    return float(answer)


def score_completions(
    completions: Sequence[str],
    answers: Sequence[float | int | str],
    questions: Sequence[str],
    steps: Sequence[Sequence[float]] | None = None,
    reward_set: str | RewardSet = "worklog",
) -> list[dict[str, float]]:
    """Score completions against reference answers with a reward set.

    Args:
        completions: generated texts.
        answers: reference answers aligned with ``completions``; floats, number strings such as
            ``"1,234"``, or GSM8K reference solutions ending in ``#### N``.
        questions: the problem statements (``step_check`` ignores numbers given there).
        steps: each reference's intermediate results (``MathProblem.steps``); ``None`` means no
            step information, so ``step_check`` scores 0.
        reward_set: a set name (``"worklog"``, ``"correctness_only"``, ``"format_only"``) or a
            :class:`RewardSet`.

    Returns:
        One dict per completion with each reward's raw value and the weighted ``total``.
    """
    parsed = [parse_answer(answer) for answer in answers]
    step_lists = [()] * len(completions) if steps is None else [tuple(s) for s in steps]
    return score(reward_set, completions, parsed, questions, step_lists)
