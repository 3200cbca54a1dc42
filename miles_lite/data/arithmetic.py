"""Offline generator of GSM8K-format arithmetic word problems.

Each problem is a short story ("Mia has 7 apples. Mia buys 5 more apples. ...") whose
quantity goes through a chain of operations. The reference solution has one line per step
with a GSM8K calculator annotation (``7+5=<<7+5=12>>12``) and ends with ``#### N``, so the
problems load, score and format exactly like GSM8K data. Difficulty is the number of steps;
numbers stay small non-negative integers and phrasing stays regular so a tiny model can learn.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from miles_lite.data.gsm8k import MathProblem, save_gsm8k

SUPPORTED_OPS = ("+", "-", "*", "/")
_MAX_ATTEMPTS = 1000


@dataclass(frozen=True)
class ArithmeticSpec:
    """Settings for :func:`generate_problems`.

    Attributes:
        min_steps, max_steps: number of operations per problem, drawn uniformly (inclusive);
            more steps make harder problems.
        min_operand, max_operand: range of the starting quantity and of each operand
            (inclusive, ``min_operand >= 1``). Multipliers and divisors are at least 2.
        ops: operations to draw from; ``"/"`` is used only when the division is exact.
        max_result: upper bound on every intermediate result, to keep numbers small.
        seed: random seed; the same spec always yields the same problems.
    """

    min_steps: int = 1
    max_steps: int = 3
    min_operand: int = 1
    max_operand: int = 20
    ops: tuple[str, ...] = ("+", "-", "*")
    max_result: int = 200
    seed: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.min_steps <= self.max_steps:
            raise ValueError(f"need 1 <= min_steps <= max_steps, got {self.min_steps}, {self.max_steps}")
        if not 1 <= self.min_operand <= self.max_operand:
            raise ValueError(
                f"need 1 <= min_operand <= max_operand, got {self.min_operand}, {self.max_operand}"
            )
        if self.max_result < self.max_operand:
            raise ValueError(f"max_result ({self.max_result}) must be >= max_operand ({self.max_operand})")
        unknown = [op for op in self.ops if op not in SUPPORTED_OPS]
        if not self.ops or unknown:
            raise ValueError(f"ops must be a non-empty subset of {SUPPORTED_OPS}, got {self.ops!r}")


@dataclass(frozen=True)
class _Story:
    """One story template: how to state the start, each operation and the question."""

    start: str
    plus: tuple[str, ...]
    minus: tuple[str, ...]
    times: tuple[str, ...]
    divide: tuple[str, ...]
    question: str


# Placeholders: {who} a name, {item} a plural noun, {b} the operand.
_STORIES = (
    _Story(
        start="{who} has {a} {item}.",
        plus=("{who} buys {b} more {item}.", "A friend gives {who} {b} more {item}."),
        minus=("{who} gives away {b} {item}.", "{who} loses {b} {item}."),
        times=("{who} ends up with {b} times as many {item} as before.",),
        divide=("{who} splits the {item} into {b} equal groups and keeps one group.",),
        question="How many {item} does {who} have now?",
    ),
    _Story(
        start="A bus has {a} people on it.",
        plus=("At the next stop, {b} people get on.",),
        minus=("At the next stop, {b} people get off.",),
        times=("Later the bus has {b} times as many people as before.",),
        divide=("The people split into {b} equal groups and only one group stays on the bus.",),
        question="How many people are on the bus now?",
    ),
    _Story(
        start="A shop has {a} boxes of {item}.",
        plus=("The shop gets {b} more boxes.",),
        minus=("The shop sells {b} boxes.",),
        times=("The shop then has {b} times as many boxes as before.",),
        divide=("The shop shares the boxes equally among {b} stores and keeps one share.",),
        question="How many boxes of {item} does the shop have now?",
    ),
)
_NAMES = ("Mia", "Tom", "Ava", "Leo", "Zoe", "Sam", "Ivy", "Ben", "Eva", "Max")
_ITEMS = ("apples", "marbles", "stickers", "books", "pens", "cards", "shells", "coins")


def _pick_operand(rng: random.Random, op: str, value: int, spec: ArithmeticSpec) -> int | None:
    """An operand for ``value op b`` that keeps the result a positive integer within bounds."""
    lo, hi = spec.min_operand, spec.max_operand
    if op == "+":
        hi = min(hi, spec.max_result - value)
        candidates = list(range(lo, hi + 1))
    elif op == "-":
        # Keep at least one item so the story never runs out of things.
        candidates = list(range(lo, min(hi, value - 1) + 1))
    elif op == "*":
        candidates = [b for b in range(max(2, lo), hi + 1) if value * b <= spec.max_result]
    else:
        candidates = [b for b in range(max(2, lo), min(hi, value) + 1) if value % b == 0]
    return rng.choice(candidates) if candidates else None


def _apply(op: str, a: int, b: int) -> int:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    return a // b


def _try_generate(rng: random.Random, spec: ArithmeticSpec) -> MathProblem | None:
    story = rng.choice(_STORIES)
    fields = {"who": rng.choice(_NAMES), "item": rng.choice(_ITEMS)}
    n_steps = rng.randint(spec.min_steps, spec.max_steps)
    value = rng.randint(spec.min_operand, spec.max_operand)
    sentences = [story.start.format(a=value, **fields)]
    lines = []
    steps = []
    phrasing = {"+": story.plus, "-": story.minus, "*": story.times, "/": story.divide}
    for _ in range(n_steps):
        op = rng.choice(spec.ops)
        operand = _pick_operand(rng, op, value, spec)
        if operand is None:
            return None
        result = _apply(op, value, operand)
        sentences.append(rng.choice(phrasing[op]).format(b=operand, **fields))
        expr = f"{value}{op}{operand}"
        lines.append(f"{expr}=<<{expr}={result}>>{result}")
        steps.append(float(result))
        value = result
    sentences.append(story.question.format(**fields))
    solution = "\n".join([*lines, f"#### {value}"])
    return MathProblem(
        question=" ".join(sentences), solution=solution, answer=float(value), steps=tuple(steps)
    )


def generate_problems(n: int, spec: ArithmeticSpec | None = None) -> list[MathProblem]:
    """Generate ``n`` GSM8K-format arithmetic word problems, deterministically from ``spec.seed``.

    Each solution line is ``a<op>b=<<a<op>b=c>>c`` and the last line is ``#### N``; every
    intermediate result is a positive integer no larger than ``spec.max_result``.

    Raises:
        ValueError: ``n`` is negative, or the spec cannot produce a valid problem (for
            example ``ops=("/",)`` with operands too small to divide).
    """
    spec = spec or ArithmeticSpec()
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = random.Random(spec.seed)
    problems = []
    for _ in range(n):
        for _ in range(_MAX_ATTEMPTS):
            problem = _try_generate(rng, spec)
            if problem is not None:
                problems.append(problem)
                break
        else:
            raise ValueError(f"{spec} could not produce a valid problem in {_MAX_ATTEMPTS} attempts")
    return problems


def write_dataset(path: str | Path, n: int, spec: ArithmeticSpec | None = None) -> Path:
    """Generate ``n`` problems and save them in GSM8K format (``.jsonl``/``.json``/``.parquet``)."""
    return save_gsm8k(generate_problems(n, spec), path)
