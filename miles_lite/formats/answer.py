"""The answer format shared by the data (prompts, reference solutions) and the rewards: the tags a
completion is asked to write, and how numbers are read and written. It imports nothing of the package:
data and rewards both build on it.

The model is asked to reason between ``<start_working_out>`` and ``<end_working_out>`` and then to
give only the final number between ``<SOLUTION>`` and ``</SOLUTION>``.

A *number token* is an optional ``-`` sign, an integer part written either as plain digits
(``1234``) or with comma thousands separators (``1,234``), and an optional decimal part
(``2.50``); a bare fraction such as ``.5`` is also accepted. A period that is not followed by a
digit ends the token, so ``"It is 12."`` yields ``12``. Currency symbols, percent signs and
scientific notation are not part of a token.

Grading is exact, never by a relative tolerance (which would grade ``2,000,001`` right for
``2,000,000``): :func:`numbers_equal` compares values exactly (``2.50 == 2.5``, ``1,234 == 1234``),
and :func:`answer_matches` compares a written number with a reference answer at the reference's
written precision (an integer answer exactly; ``33.33`` accepts ``33.333``, not ``33.3``).
:func:`parse_solution_number` reads a final answer the way people write one: ``$1,234``, ``-$5``,
``50%``, ``18 dollars``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from decimal import ROUND_HALF_UP, Decimal
from typing import Any

WORK_START = "<start_working_out>"
WORK_END = "<end_working_out>"
SOLUTION_START = "<SOLUTION>"
SOLUTION_END = "</SOLUTION>"
# In the order they must appear in a well-formed completion.
ANSWER_TAGS = (WORK_START, WORK_END, SOLUTION_START, SOLUTION_END)
# The calculator tool's call and result (multi-turn rollouts with rollout.environment=calculator).
CALC_START, CALC_END = "<calc>", "</calc>"
RESULT_START, RESULT_END = "<result>", "</result>"
CALCULATOR_TAGS = (CALC_START, CALC_END, RESULT_START, RESULT_END)
# A reference solution (GSM8K) ends with this marker and the final number.
_FINAL_MARKER = "####"
_FINAL_HINT = "GSM8K answers end with '#### <number>'"

# Integer part: comma-grouped thousands (only when every group has exactly three digits and no
# digit follows, so "12,3456" is two numbers) or a plain digit run.
_INT = r"(?:[0-9]{1,3}(?:,[0-9]{3})+(?![0-9])|[0-9]+)"
_UNSIGNED = rf"(?:{_INT}(?:\.[0-9]+)?|\.[0-9]+)"
_FULL_RE = re.compile(rf"[-+]?{_UNSIGNED}")
# Inside running text a "-" is a sign only when it does not follow a word character or a
# closing bracket, so "5-3=2" reads as 5, 3, 2 rather than 5, -3, 2. The look-behind on the
# digits stops a token from starting in the middle of another one ("1.2.3" -> 1.2 only). A sign
# may stand before a "$" ("-$5" is -5).
_FIND_RE = re.compile(rf"(?P<sign>(?<![\w)\]])-)?\$?(?<![0-9.])(?P<number>{_UNSIGNED})")
# A written final answer: a sign before or after an optional "$", the number, then an optional "%"
# or a unit of at most two words ("18 dollars", "3 square feet"), and an optional closing period.
_UNIT = r"[A-Za-z][A-Za-z/]*"
_ANSWER_RE = re.compile(
    rf"(?P<sign>[-+]?)\s*\$?\s*(?P<number>[-+]?{_UNSIGNED})\s*(?:%|{_UNIT}(?:\s+{_UNIT})?)?\s*\.?"
)
# Unicode minus signs models write for "-".
_MINUS = str.maketrans({"\u2212": "-", "\u2013": "-"})


def parse_number(text: str) -> float | None:
    """Parse ``text`` as a single number token, or return ``None``.

    Leading and trailing whitespace is ignored; anything else (``$``, ``%``, units, words, a
    trailing period, a second number) makes the text not a number.

    Examples: ``"1,234" -> 1234.0``, ``" -3 " -> -3.0``, ``"2.50" -> 2.5``, ``"$10" -> None``,
    ``"12." -> None``.
    """
    stripped = text.strip()
    if not _FULL_RE.fullmatch(stripped):
        return None
    value = float(stripped.replace(",", ""))
    return value if math.isfinite(value) else None


def find_numbers(text: str) -> list[float]:
    """Return the values of every number token in ``text``, in order of appearance.

    ``"3*4=12, then 1,234."`` gives ``[3.0, 4.0, 12.0, 1234.0]``.
    """
    values = []
    for match in _FIND_RE.finditer(text):
        value = float(match.group("number").replace(",", ""))
        value = -value if match.group("sign") else value
        if math.isfinite(value):
            values.append(value)
    return values


def parse_solution_number(text: str) -> float | None:
    """Parse a written final answer: one number with an optional ``$``, sign, ``%`` or trailing unit.

    ``"$1,234" -> 1234.0``, ``"-$5" -> -5.0``, ``"$-5" -> -5.0``, ``"50%" -> 50.0``,
    ``"18 dollars." -> 18.0``; ``"$10 + $2"``, ``"--5"``, ``"12 apples and 3 pears"`` -> None.
    """
    match = _ANSWER_RE.fullmatch(text.translate(_MINUS).strip())
    if match is None:
        return None
    sign, number = match.group("sign"), match.group("number")
    if sign and number[0] in "+-":
        return None  # two signs
    value = parse_number(number)
    return None if value is None else (-value if sign == "-" else value)


def numbers_equal(a: float, b: float) -> bool:
    """Exact equality of two values (both parsed from decimal text, so ``2.50`` equals ``2.5``).

    Integers are exact up to 2**53 (about 9e15), past any answer a math dataset holds.
    """
    return float(a) == float(b)


def decimal_places(value: float) -> int:
    """Digits after the decimal point in the shortest text of ``value``: ``2.0 -> 0``, ``33.33 -> 2``."""
    if not math.isfinite(value):
        raise ValueError(f"decimal_places of a non-finite number {value!r}")
    if float(value).is_integer():
        return 0
    return max(0, -int(Decimal(repr(float(value))).as_tuple().exponent))


def answer_matches(value: float, reference: float) -> bool:
    """Whether a written ``value`` is the ``reference`` answer, at the reference's written precision.

    An integer reference needs the exact value (``2,000,001`` is wrong for ``2,000,000``; ``2.4`` is
    wrong for ``2``; ``2.0`` is right). A reference written with ``d >= 1`` decimal places (``33.33``:
    ``d = 2``) accepts a value written with at least ``d`` places that rounds half-up to it at ``d``
    places (``33.33`` and ``33.333`` are right, ``33.3`` and ``33.34`` are not).
    """
    if not (math.isfinite(value) and math.isfinite(reference)):
        return False
    places = decimal_places(reference)
    if places == 0:
        return numbers_equal(value, reference)
    if decimal_places(value) < places:
        return False
    quantum = Decimal(1).scaleb(-places)
    return Decimal(repr(float(value))).quantize(quantum, rounding=ROUND_HALF_UP) == Decimal(repr(float(reference)))


def contains_number(values: Iterable[float], target: float) -> bool:
    """Whether any value in ``values`` equals ``target`` exactly (:func:`numbers_equal`)."""
    return any(numbers_equal(v, target) for v in values)


def contains_answer(values: Iterable[float], reference: float) -> bool:
    """Whether any written value in ``values`` is the ``reference`` answer (:func:`answer_matches`)."""
    return any(answer_matches(v, reference) for v in values)


def format_number(value: float) -> str:
    """Format a number the way a reference answer is written: ``12.0 -> "12"``, ``2.5 -> "2.5"``.

    No thousands separators and no trailing zeros, so the result round-trips through
    :func:`parse_number`.
    """
    if not math.isfinite(value):
        raise ValueError(f"cannot format non-finite number {value!r}")
    if float(value).is_integer():
        return str(int(value))
    text = f"{value:.10f}".rstrip("0").rstrip(".")
    return "0" if text in ("-0", "") else text


def parse_final_answer(text: str, *, where: str = "problem") -> float:
    """Read the final answer written after the last ``#### `` marker of a reference solution.

    Commas, a sign and decimals are allowed (``#### 1,234``, ``#### -3``, ``#### 2.50``). Tags
    such as ``<SOLUTION>`` are never consulted: the ``####`` line is the only source of truth.

    Raises:
        ValueError: the marker is missing or not followed by a number; the message starts with
            ``where`` (e.g. ``"data.jsonl: line 7: field 'answer'"``) so the record can be found.
    """
    index = text.rfind(_FINAL_MARKER)
    if index < 0:
        raise ValueError(f"{where} has no '#### N' final answer; {_FINAL_HINT}")
    tail = text[index + len(_FINAL_MARKER):].strip()
    token = tail.splitlines()[0] if tail else ""
    value = parse_number(token)
    if value is None:
        raise ValueError(
            f"{where} has {token!r} after '####', which is not a number; {_FINAL_HINT} "
            "(commas, a sign and decimals are fine, units and '$' are not)"
        )
    return value


def numeric_label(label: Any) -> float:
    """A label as a float: a number, a number string ("1,234") or a "#### N" solution; NaN otherwise."""
    if isinstance(label, bool):
        return math.nan
    if isinstance(label, int | float):
        return float(label)
    if isinstance(label, str):
        text = label.rsplit("####", 1)[-1] if "####" in label else label
        value = parse_number(text.strip())
        return math.nan if value is None else value
    return math.nan
