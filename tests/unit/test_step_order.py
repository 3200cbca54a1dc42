"""When synchronous rollouts start the next step's generation right after a push (before this step's metrics are
written): not after the last step, not before an evaluation, not where the roles hand the device over, and never
with one-step-off rollouts (their pipeline starts batches itself)."""

from __future__ import annotations

from types import SimpleNamespace

from miles_lite.config.schema import MilesConfig
from miles_lite.run.driver import starts_next_now


def _cfg(steps: int = 10, async_steps: int = 0, eval_every: int = 0) -> MilesConfig:
    cfg = MilesConfig()
    cfg.experiment.steps, cfg.experiment.eval_every, cfg.rollout.async_steps = steps, eval_every, async_steps
    return cfg


def test_the_next_generation_starts_after_the_push_only_where_nothing_needs_the_engines_idle() -> None:
    idle = SimpleNamespace(enabled=False)
    # Steps count from 1: step 10 is the last of 10.
    assert starts_next_now(_cfg(), 1, idle, evaluates=False)
    assert starts_next_now(_cfg(), 9, idle, evaluates=False)
    assert not starts_next_now(_cfg(), 10, idle, evaluates=False)  # the last step: nothing comes next
    assert not starts_next_now(_cfg(async_steps=1), 1, idle, evaluates=False)
    assert not starts_next_now(_cfg(), 1, SimpleNamespace(enabled=True), evaluates=False)
    # An evaluation opens step 6 (eval_every=5: after 5 steps done): it runs with no generation in flight.
    assert not starts_next_now(_cfg(eval_every=5), 5, idle, evaluates=True)
    assert starts_next_now(_cfg(eval_every=5), 5, idle, evaluates=False)
    assert starts_next_now(_cfg(eval_every=5), 6, idle, evaluates=True)
