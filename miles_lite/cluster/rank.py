"""One trainer rank: its `TrainerActor`, its checkpointer and its weight-group membership.

The same body serves both trainer roles: `LocalTrainer` holds one in the driver's process and
`RayTrainerGroup` runs one per Ray actor of the trainer gang.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from miles_lite.checkpoint.driver_state import DriverState
from miles_lite.checkpoint.run_state import RankCheckpointer
from miles_lite.config.schema import MilesConfig
from miles_lite.trainer.layout import ParamLayout
from miles_lite.types import TrainBatch


@dataclass(frozen=True)
class RankCoords:
    """Where a rank sits in the trainer's grid (global rank, tensor- and data-parallel coordinates)."""

    rank: int
    tp_rank: int
    dp_rank: int


class TrainerRank:
    """A trainer rank once `setup` has run: every call of a trainer role lands here, on each rank."""

    def __init__(self) -> None:
        self.actor: Any = None
        self.checkpointer: RankCheckpointer | None = None
        self.sender: Any = None

    def setup(self, cfg: MilesConfig, rank: int, world_size: int, init_method: str, total_steps: int) -> RankCoords:
        """Join the trainer's process group and build this rank's model shard and optimizer."""
        from miles_lite.trainer.actor import TrainerActor

        self.actor = TrainerActor(cfg, rank=rank, world_size=world_size, init_method=init_method,
                                  total_steps=total_steps)
        self.checkpointer = RankCheckpointer(cfg)
        self.checkpointer.prepare(self.actor)
        par = self.actor.par
        return RankCoords(par.rank, par.tp_rank, par.dp_rank)

    def layouts(self) -> list[ParamLayout]:
        return list(self.actor.layouts.values())

    def weight_shards(self, copy: bool = False) -> dict[str, torch.Tensor]:
        """This rank's `{megatron name: tensor}` (`copy`: clones, for callers that keep them while training goes on)."""
        return {name: tensor.clone() if copy else tensor for name, tensor, _ in self.actor.named_shards()}

    # ---- weight sync, shard mode (`weight_sync.senders.ShardSenders`) -------------------------------

    def join_weight_group(self, master_address: str, master_port: int, world_size: int, group_name: str,
                          backend: str, timeout_s: float, key: str | None = None) -> None:
        """Join the weight-update group as group rank = this rank's TP rank (blocks until all joined)."""
        from miles_lite.weight_sync.senders import RankSender

        if self.sender is None:
            self.sender = RankSender(self.actor.par.tp_rank, self.actor.par.tp_size)
        self.sender.join(master_address, master_port, world_size, group_name, backend, timeout_s, key)

    def send_weight_bucket(self, schedule: Any) -> Any:
        """Send this rank's part of one bucket from the live parameters; its `SendStats`."""
        return self.sender.send(self.weight_shards(), schedule)

    def leave_weight_group(self) -> None:
        if self.sender is not None:
            self.sender.leave()

    # ---- compute ----------------------------------------------------------------------------------

    def compute_logprobs(self, batch: TrainBatch, model: str = "policy", quantized: bool = True) -> list[list[float]]:
        return self.actor.compute_logprobs(batch, model, quantized)

    def train_step(self, batch: TrainBatch, distill_coef: float | None = None) -> dict[str, float]:
        return self.actor.train_step(batch, distill_coef)

    def sft_step(self, batch: TrainBatch, lr: float | None = None) -> dict[str, float]:
        return self.actor.sft_step(batch, lr)

    def export_hf_state_dict(self) -> dict[str, torch.Tensor]:
        return self.actor.export_hf_state_dict()

    def offload(self, parts: tuple[str, ...]) -> dict[str, float]:
        return self.actor.offload(parts)

    def onload(self, parts: tuple[str, ...]) -> dict[str, float]:
        return self.actor.onload(parts)

    def memory_stats(self) -> dict[str, float]:
        return self.actor.memory_stats()

    def adapter_state(self) -> dict[str, torch.Tensor]:
        return self.actor.adapter_state()

    def state_dict(self) -> dict[str, Any]:
        return self.actor.state_dict_for_checkpoint()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.actor.load_checkpoint_state(state)

    # ---- checkpoints ------------------------------------------------------------------------------

    def save_checkpoint(self, step: int, driver: DriverState | None, final: bool = False) -> Any:
        """Snapshot this rank's shards (rank 0 adds `driver`) as checkpoint `step`; `final` waits for the commit."""
        assert self.checkpointer is not None
        stats = self.checkpointer.save(self.actor, step, driver)
        return (self.checkpointer.finalize() or stats) if final else stats

    def finalize_checkpoint(self) -> Any:
        """Wait for the save in flight to commit; its `SaveStats` (None when nothing was saved)."""
        return self.checkpointer.finalize() if self.checkpointer is not None else None

    def restore_checkpoint(self, path: str) -> DriverState | None:
        """Load checkpoint `path` (any TP/DP it was saved with); the driver state it holds, if any."""
        return RankCheckpointer.restore(self.actor, path)

    def close(self) -> None:
        self.leave_weight_group()
        if self.checkpointer is not None:
            self.checkpointer.close()
        if self.actor is not None:
            self.actor.close()
