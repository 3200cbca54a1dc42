"""The local spec's previous micro-batch layout, kept as the reference the padded layout is checked against.

Before the padded `[B, S]` batches (packing.py), a local-spec micro-batch was one packed row of real
tokens under a `[T, T]` block-diagonal causal mask, planned by real tokens alone. Tests compare
log-probs, losses and gradients of the two layouts, and `benchmarks/cpu_micro_batches.py` times them;
nothing in a run uses this module.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from miles_lite.trainer import actor, forward, packing


@contextlib.contextmanager
def packed_row_layout() -> Iterator[None]:
    """Within the block, every `TrainerActor` on the local spec runs its micro-batches as packed rows."""
    saved = (forward._hidden_states, actor.plan_micro_batches)
    forward._hidden_states = forward.packed_row_hidden_states
    actor.plan_micro_batches = lambda lengths, budget, padded=False: packing.plan_micro_batches(lengths, budget)
    try:
        yield
    finally:
        forward._hidden_states, actor.plan_micro_batches = saved
