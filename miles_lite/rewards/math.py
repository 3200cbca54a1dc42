"""Rewards for math completions in the tagged answer format.

A well-formed completion is::

    <start_working_out> ...reasoning... <end_working_out><SOLUTION>72</SOLUTION>

Every reward returns a raw value in ``[0, 1]`` per completion (weights are applied by a
reward set, see :mod:`miles_lite.rewards.registry`). A written number is graded against the
reference answer exactly at the reference's written precision (:func:`answer_matches`: an integer
answer needs the exact integer, ``1,234 == 1234``, ``2.50 == 2.5``). The reference answer always
comes from the dataset (the ``#### N`` line), never from tags in a reference text.

Each ``*_check`` function here has the batch reward signature::

    fn(completions, *, answers, questions, steps) -> list[float]

and is backed by a per-completion ``score_*`` function.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

from miles_lite.formats.answer import (
    ANSWER_TAGS,
    SOLUTION_END,
    SOLUTION_START,
    WORK_END,
    WORK_START,
    answer_matches,
    contains_answer,
    contains_number,
    find_numbers,
    numbers_equal,
    parse_number,
    parse_solution_number,
)

TAG_CREDIT = 0.125
_FORMAT_RE = re.compile(
    rf"\s*{re.escape(WORK_START)}.*?{re.escape(WORK_END)}\s*"
    rf"{re.escape(SOLUTION_START)}.*?{re.escape(SOLUTION_END)}\s*",
    re.DOTALL,
)
_SOLUTION_RE = re.compile(rf"{re.escape(SOLUTION_START)}(.*?){re.escape(SOLUTION_END)}", re.DOTALL)


def solution_text(completion: str) -> str | None:
    """Content of the first closed ``<SOLUTION>...</SOLUTION>`` block, or ``None`` if there is none."""
    match = _SOLUTION_RE.search(completion)
    return match.group(1) if match else None


def solution_number(completion: str) -> float | None:
    """The number held by the first SOLUTION block, if the block holds just a number."""
    text = solution_text(completion)
    return None if text is None else parse_number(text)


def score_format(completion: str) -> float:
    """1.0 for exactly one working-out block followed by one SOLUTION block, else 0.0.

    Each of the four tags must occur exactly once, in order, with only whitespace before the
    first tag, between the two blocks and after the last tag.
    """
    if any(completion.count(tag) != 1 for tag in ANSWER_TAGS):
        return 0.0
    return 1.0 if _FORMAT_RE.fullmatch(completion) else 0.0


def score_correctness(completion: str, answer: float) -> float:
    """1.0 if the first SOLUTION block holds the answer as a person would write it, else 0.0.

    One number graded by :func:`answer_matches`, with optional whitespace, ``$``, sign, ``%``, a
    unit of at most two words and a closing period (``$1,234``, ``-$5``, ``50%``, ``18 dollars.``,
    see :func:`parse_solution_number`). An expression, a second number or an unclosed block
    scores 0.0.
    """
    text = solution_text(completion)
    value = None if text is None else parse_solution_number(text)
    return 1.0 if value is not None and answer_matches(value, answer) else 0.0


def score_exact(completion: str, answer: float) -> float:
    """1.0 if the format check passes and the SOLUTION block holds just the right number, else 0.0.

    Stricter than :func:`score_correctness`: no ``$``, ``%`` or unit (only whitespace and commas).
    """
    value = solution_number(completion)
    if value is None or not answer_matches(value, answer):
        return 0.0
    return score_format(completion)


def score_lenient_correctness(completion: str, answer: float) -> float:
    """1.0 if any number anywhere in the completion is the answer (:func:`answer_matches`), else 0.0."""
    return 1.0 if contains_answer(find_numbers(completion), answer) else 0.0


def score_tags(completion: str) -> float:
    """``TAG_CREDIT`` (0.125) per answer tag that occurs exactly once; at most 0.5.

    A tag that occurs twice or more earns nothing, so repeating tags cannot farm credit.
    """
    return TAG_CREDIT * sum(completion.count(tag) == 1 for tag in ANSWER_TAGS)


def score_solution_number(completion: str) -> float:
    """1.0 if the first SOLUTION block holds just a number (whitespace allowed), else 0.0."""
    return 0.0 if solution_number(completion) is None else 1.0


def relevant_steps(steps: Sequence[float], answer: float, question: str) -> list[float]:
    """Reference intermediate results worth rewarding: distinct values that are neither the
    final answer nor a number already given in the question (copying those shows no work)."""
    given = find_numbers(question)
    relevant: list[float] = []
    for step in steps:
        if numbers_equal(step, answer) or contains_number(given, step) or contains_number(relevant, step):
            continue
        relevant.append(step)
    return relevant


def step_budget(n_relevant: int) -> int:
    """How many new numbers a completion may write before :func:`score_steps` is shrunk.

    Two per relevant step (a result and the operand that produced it) plus four for the final
    answer and unit conversions such as 60 or 100.
    """
    return 2 * n_relevant + 4


def score_steps(completion: str, answer: float, question: str, steps: Sequence[float]) -> float:
    """Fraction of the relevant reference steps that appear as numbers in the completion.

    Relevant steps are given by :func:`relevant_steps`; if there are none (single-step
    problems, or no step annotations) the score is 0.0, so this reward stays about shown work
    rather than duplicating the correctness rewards.

    To stop a completion from listing many numbers in the hope of hitting the steps, the
    fraction is multiplied by ``min(1, budget / n_new)``, where ``n_new`` counts the distinct
    numbers in the completion that are not in the question and ``budget`` is
    :func:`step_budget`. The factor falls smoothly (as ``1/n``) once the budget is exceeded.
    """
    relevant = relevant_steps(steps, answer, question)
    if not relevant:
        return 0.0
    written = set(find_numbers(completion))
    hits = sum(contains_answer(written, step) for step in relevant)
    given = find_numbers(question)
    n_new = sum(not contains_number(given, value) for value in written)
    shrink = min(1.0, step_budget(len(relevant)) / n_new) if n_new else 1.0
    return hits / len(relevant) * shrink


# Batch rewards. They all share one keyword signature so a reward set can call any of them;
# each argument is a sequence with one entry per completion.
Steps = Sequence[Sequence[float]]


def _batch(completions: Sequence[str], fn: Callable[[int, str], float]) -> list[float]:
    return [float(fn(index, completion)) for index, completion in enumerate(completions)]


def exact_check(
    completions: Sequence[str], *, answers: Sequence[float], questions: Sequence[str], steps: Steps
) -> list[float]:
    """Batch :func:`score_exact`: format passes and the SOLUTION number is right."""
    return _batch(completions, lambda i, c: score_exact(c, answers[i]))


def correctness_check(
    completions: Sequence[str], *, answers: Sequence[float], questions: Sequence[str], steps: Steps
) -> list[float]:
    """Batch :func:`score_correctness`: the first SOLUTION block is the right number."""
    return _batch(completions, lambda i, c: score_correctness(c, answers[i]))


def lenient_correctness_check(
    completions: Sequence[str], *, answers: Sequence[float], questions: Sequence[str], steps: Steps
) -> list[float]:
    """Batch :func:`score_lenient_correctness`: the right number appears anywhere."""
    return _batch(completions, lambda i, c: score_lenient_correctness(c, answers[i]))


def format_check(
    completions: Sequence[str], *, answers: Sequence[float], questions: Sequence[str], steps: Steps
) -> list[float]:
    """Batch :func:`score_format`: exactly one working-out block then one SOLUTION block."""
    return _batch(completions, lambda i, c: score_format(c))


def tag_check(
    completions: Sequence[str], *, answers: Sequence[float], questions: Sequence[str], steps: Steps
) -> list[float]:
    """Batch :func:`score_tags`: 0.125 per tag present exactly once."""
    return _batch(completions, lambda i, c: score_tags(c))


def step_check(
    completions: Sequence[str], *, answers: Sequence[float], questions: Sequence[str], steps: Steps
) -> list[float]:
    """Batch :func:`score_steps`: share of the reference's intermediate results shown."""
    return _batch(completions, lambda i, c: score_steps(c, answers[i], questions[i], steps[i]))


def solution_number_check(
    completions: Sequence[str], *, answers: Sequence[float], questions: Sequence[str], steps: Steps
) -> list[float]:
    """Batch :func:`score_solution_number`: the SOLUTION block holds just a number."""
    return _batch(completions, lambda i, c: score_solution_number(c))
