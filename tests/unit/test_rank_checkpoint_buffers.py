"""Which trainer ranks reserve host buffers for their checkpoints at start-up: a hand-off run's saves write the
host copies its offload stages (`config.colocation.saves_staged_copies`), so it reserves none; other runs
reserve what their first save needs."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

import miles_lite.checkpoint.run_state as run_state
import miles_lite.trainer.actor as actor_module
from miles_lite.cluster.rank import TrainerRank
from miles_lite.config.colocation import saves_staged_copies
from miles_lite.config.compose import load_config
from miles_lite.config.views import TrainerRoleConfig

SAVING = ["checkpoint.dir=/ckpt", "checkpoint.interval=1"]
HANDOFF = ["cluster.placement=colocated", "cluster.colocated_memory=handoff"]


@pytest.mark.parametrize(("overrides", "staged"), [
    (HANDOFF, True),
    ([*HANDOFF, "trainer.offload.when=needed"], True),  # what stays is staged on a step that saves
    ([*HANDOFF, "trainer.offload.optimizer=false"], False),  # the optimizer state stays: nothing staged of it
    ([*HANDOFF, "trainer.offload.params=false"], False),
    (["cluster.placement=colocated", "cluster.colocated_memory=resident"], False),
    (["cluster.placement=disaggregated"], False),
])
def test_only_a_handoff_staging_params_and_optimizer_saves_its_copies(overrides: list[str], staged: bool) -> None:
    cfg = load_config(overrides)
    assert saves_staged_copies(cfg.cluster, cfg.trainer.offload) is staged


class _Actor:
    """The trainer actor as `TrainerRank.setup` sees it (the checkpoint's sizes are patched in below)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.par = SimpleNamespace(rank=0, tp_rank=0, dp_rank=0, ep_rank=0)


@pytest.mark.parametrize(("overrides", "reserved"), [(HANDOFF, 0), (["cluster.placement=disaggregated"], 4096)])
def test_a_handoff_rank_reserves_no_snapshot_buffers(monkeypatch: pytest.MonkeyPatch, overrides: list[str],
                                                     reserved: int) -> None:
    monkeypatch.setattr(actor_module, "TrainerActor", _Actor)
    monkeypatch.setattr(run_state, "snapshot_sizes", lambda actor: [4096])
    rank = TrainerRank()
    rank.setup(TrainerRoleConfig.of(load_config([*SAVING, *overrides])), 0, 1, "tcp://127.0.0.1:1", 3)
    assert rank.checkpointer is not None
    buffers = rank.checkpointer.buffers
    try:
        if buffers is not None:
            buffers.wait_reserved()
        assert (buffers.reserved_bytes if buffers is not None else 0) == reserved
    finally:
        rank.checkpointer.close()
