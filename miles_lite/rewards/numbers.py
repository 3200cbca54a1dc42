"""Number parsing shared by the dataset loaders and the reward functions.

A *number token* is an optional ``-`` sign, an integer part written either as plain digits
(``1234``) or with comma thousands separators (``1,234``), and an optional decimal part
(``2.50``); a bare fraction such as ``.5`` is also accepted. A period that is not followed by a
digit ends the token, so ``"It is 12."`` yields ``12``. Currency symbols, percent signs and
scientific notation are not part of a token. Values are compared with a relative tolerance so
that ``2.50 == 2.5`` and ``1,234 == 1234``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable

# Relative tolerance for comparing numbers by value. The absolute floor keeps an answer of 0
# comparable (a purely relative test would demand exact equality there).
REL_TOL = 1e-6
ABS_TOL = 1e-9

# Integer part: comma-grouped thousands (only when every group has exactly three digits and no
# digit follows, so "12,3456" is two numbers) or a plain digit run.
_INT = r"(?:[0-9]{1,3}(?:,[0-9]{3})+(?![0-9])|[0-9]+)"
_UNSIGNED = rf"(?:{_INT}(?:\.[0-9]+)?|\.[0-9]+)"
_FULL_RE = re.compile(rf"[-+]?{_UNSIGNED}")
# Inside running text a "-" is a sign only when it does not follow a word character or a
# closing bracket, so "5-3=2" reads as 5, 3, 2 rather than 5, -3, 2. The look-behind on the
# digits stops a token from starting in the middle of another one ("1.2.3" -> 1.2 only).
_FIND_RE = re.compile(rf"(?:(?<![\w)\]])-)?(?<![0-9.]){_UNSIGNED}")


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
        value = float(match.group(0).replace(",", ""))
        if math.isfinite(value):
            values.append(value)
    return values


def numbers_equal(a: float, b: float) -> bool:
    """Whether two numbers are equal up to a relative tolerance of ``REL_TOL``."""
    return math.isclose(a, b, rel_tol=REL_TOL, abs_tol=ABS_TOL)


def contains_number(values: Iterable[float], target: float) -> bool:
    """Whether any value in ``values`` equals ``target`` by :func:`numbers_equal`."""
    return any(numbers_equal(v, target) for v in values)


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
