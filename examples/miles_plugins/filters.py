"""Example group filter for dynamic sampling (``rollout.dynamic_sampling=true``).

Name it with ``rollout.group_filter=miles_plugins.filters:signal_with_a_right_answer``: groups it
rejects are dropped and replaced by groups of fresh prompts.
"""

from __future__ import annotations

from miles_lite.types import Group


def signal_with_a_right_answer(group: Group) -> bool:
    """Keep a group whose rewards differ and where at least one completion has the right number."""
    right = any(s.rewards.get("correctness_check", 0.0) > 0 for s in group.samples)
    return right and not group.is_zero_signal
