"""Built-in rewards of records, called with the whole `RewardBatch` (they read the labels as they are).

- `exact_match`: the completion's final answer equals the label after normalising case and whitespace;
  `rewards.answer_pattern` (a regex) extracts the answer (its first group, if it has one, else the whole
  match; the last match counts); without it the whole completion is the answer. A list label accepts
  any of its elements.
- `math_answer`: the number in the completion's last `\\boxed{...}`, or else in its `<SOLUTION>` block,
  equals the numeric label (a number, a number string or a "#### N" solution).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from miles_lite.formats.answer import answer_matches, numeric_label, parse_solution_number
from miles_lite.rewards.batch import RewardBatch
from miles_lite.rewards.math import solution_text

_BOXED = "\\boxed{"


def normalise(text: str) -> str:
    """Case-folded, with runs of whitespace as one space and none at the ends."""
    return " ".join(text.split()).casefold()


def _label_texts(label: Any) -> list[str]:
    values = label if isinstance(label, list) else [label]
    return [normalise(v if isinstance(v, str) else json.dumps(v)) for v in values]


class ExactMatch:
    """`exact_match` with an optional answer pattern (`rewards.answer_pattern`)."""

    def __init__(self, pattern: str | None = None) -> None:
        try:
            self.pattern = re.compile(pattern, re.DOTALL) if pattern else None
        except re.error as exc:
            raise ValueError(f"rewards.answer_pattern={pattern!r} is not a regular expression: {exc}") from None

    def answer(self, completion: str) -> str | None:
        """The completion's final answer, or None when the pattern does not match."""
        if self.pattern is None:
            return completion
        matches = list(self.pattern.finditer(completion))
        if not matches:
            return None
        last = matches[-1]
        return last.group(1) if self.pattern.groups else last.group(0)

    def __call__(self, batch: RewardBatch) -> list[float]:
        scores = []
        for completion, label in zip(batch.completions, batch.labels, strict=True):
            answer = self.answer(completion)
            scores.append(float(answer is not None and normalise(answer) in _label_texts(label)))
        return scores


def boxed_text(completion: str) -> str | None:
    """The contents of the last `\\boxed{...}` (nested braces balanced), None without one."""
    start = completion.rfind(_BOXED)
    if start < 0:
        return None
    depth, i = 1, start + len(_BOXED)
    for j in range(i, len(completion)):
        depth += {"{": 1, "}": -1}.get(completion[j], 0)
        if depth == 0:
            return completion[i:j]
    return None


def math_answer(batch: RewardBatch) -> list[float]:
    """1.0 when the boxed (else `<SOLUTION>`) number equals the numeric label, else 0.0."""
    scores = []
    for completion, label in zip(batch.completions, batch.labels, strict=True):
        reference = numeric_label(label)
        text = boxed_text(completion)
        text = solution_text(completion) if text is None else text
        value = parse_solution_number(text) if text is not None else None
        scores.append(float(value is not None and not math.isnan(reference) and answer_matches(value, reference)))
    return scores
