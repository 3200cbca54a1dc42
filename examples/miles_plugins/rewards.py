"""Example custom rewards: plain functions with the batch reward signature."""

from __future__ import annotations

from collections.abc import Sequence


def brevity(completions: Sequence[str], *, answers: Sequence[float], questions: Sequence[str],
            steps: Sequence[Sequence[float]]) -> list[float]:
    """1.0 for a completion of at most 200 characters, falling linearly to 0.0 at 600."""
    return [min(1.0, max(0.0, (600 - len(c)) / 400)) for c in completions]
