"""Rewards of the letters task, in TRL's convention: every record column arrives by its own name.

`reversed_letters` gives partial credit, the share of positions right, so that early samples that are
nearly right already get a signal; a sample is correct (held-out exact accuracy) only at 1.0.
`sorted_letters` scores the "sort" source of the two-source mix from the prompt itself: the answer must
be the prompt's letters in alphabetical order.
"""

from __future__ import annotations


def _share_right(answer: str, label: str) -> float:
    got, want = answer.split(), label.split()
    if got == want:
        return 1.0
    same = sum(a == b for a, b in zip(got, want, strict=False))
    # Partial credit stays below 1.0 and shrinks for answers of the wrong length.
    return 0.5 * same / max(len(want), len(got))


def reversed_letters(completions, label, **kwargs):
    """Share of letters in the right place (1.0: the reversed sequence exactly)."""
    return [_share_right(c, y) for c, y in zip(completions, label, strict=True)]


# The best raw value: evaluation counts a sample right when it reaches it (rewards.success).
reversed_letters.max_value = 1.0


def sorted_letters(prompts, completions, **kwargs):
    """1.0 when the completion lists the prompt's letters in alphabetical order, partial credit otherwise."""
    wanted = [" ".join(sorted(p.split(":", 1)[1].split())) for p in prompts]
    return [_share_right(c, w) for c, w in zip(completions, wanted, strict=True)]


sorted_letters.max_value = 1.0
