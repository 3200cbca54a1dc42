"""One trainer rank: its `TrainerActor`, its checkpointer and its weight-group membership.

The same body serves both trainer roles: `LocalTrainer` holds one in the driver's process and
`RayTrainerGroup` runs one per Ray actor of the trainer gang.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from miles_lite.checkpoint.driver_state import DriverState
from miles_lite.checkpoint.run_state import RankCheckpointer
from miles_lite.config.colocation import saves_staged_copies
from miles_lite.config.views import TrainerRoleConfig
from miles_lite.trainer.layout import ParamLayout
from miles_lite.trainer.offload import OverlapRoom
from miles_lite.types import TrainBatch


@dataclass(frozen=True)
class RankCoords:
    """Where a rank sits in the trainer's grid (global rank, tensor-, data- and expert-parallel coordinates)."""

    rank: int
    tp_rank: int
    dp_rank: int
    ep_rank: int = 0


def weight_senders(coords: Sequence[RankCoords], tp: int) -> list[int]:
    """The global ranks whose weights a push reads, in sender order (`weight_sync.plan`): TP ranks 0..tp-1 of
    data-parallel rank 0, then, for each expert-parallel rank none of those is on, its lowest global rank."""
    by_tp = {c.tp_rank: c for c in coords if c.dp_rank == 0}
    if sorted(by_tp) != list(range(tp)):
        raise ValueError(f"data-parallel rank 0 holds TP ranks {sorted(by_tp)}, not 0..{tp - 1}")
    senders = [by_tp[t] for t in range(tp)]
    covered = {c.ep_rank for c in senders}
    for c in sorted(coords, key=lambda c: c.rank):
        if c.ep_rank not in covered:
            senders.append(c)
            covered.add(c.ep_rank)
    return [c.rank for c in senders]


def expert_senders(coords: Sequence[RankCoords], senders: Sequence[int], ep: int, num_experts: int) -> dict[int, int]:
    """Global routed expert -> the sender (index into `senders`) holding it: expert e lives on expert-parallel rank
    e // (num_experts / ep), and the first sender on that rank sends it."""
    if num_experts % ep:
        raise ValueError(f"trainer.ep={ep} must divide the model's {num_experts} routed experts")
    ep_of = {c.rank: c.ep_rank for c in coords}
    first: dict[int, int] = {}
    for index, rank in enumerate(senders):
        first.setdefault(ep_of[rank], index)
    per_rank = num_experts // ep
    missing = sorted(set(range(ep)) - set(first))
    if missing:
        raise ValueError(f"no weight sender on expert-parallel ranks {missing}")
    return {e: first[e // per_rank] for e in range(num_experts)}


class TrainerRank:
    """A trainer rank once `setup` has run: every call of a trainer role lands here, on each rank."""

    def __init__(self) -> None:
        self.actor: Any = None
        self.checkpointer: RankCheckpointer | None = None
        self.sender: Any = None

    def setup(self, cfg: TrainerRoleConfig, rank: int, world_size: int, init_method: str,
              total_steps: int) -> RankCoords:
        """Join the trainer's process group and build this rank's model shard and optimizer."""
        from miles_lite.trainer.actor import TrainerActor

        self.actor = TrainerActor(cfg.actor, rank=rank, world_size=world_size, init_method=init_method,
                                  total_steps=total_steps)
        self.checkpointer = RankCheckpointer(cfg.checkpoint, cfg.actor.model)
        self.checkpointer.prepare(self.actor, staged=saves_staged_copies(cfg.cluster, cfg.actor.trainer.offload))
        par = self.actor.par
        return RankCoords(par.rank, par.tp_rank, par.dp_rank, par.ep_rank)

    def layouts(self) -> list[ParamLayout]:
        """This rank's parameter layouts, each routed expert's repeated for every expert-parallel rank (the
        same Megatron parameter holds expert j of each EP rank's share): every tensor a push moves."""
        from miles_lite.trainer.hf_convert import expert_on_rank

        par, out = self.actor.par, []
        for layout in self.actor.layouts.values():
            if layout.expert is None:
                out.append(layout)
            else:
                out += [expert_on_rank(layout, r, par.ep_size, self.actor.policy.spec.num_experts)
                        for r in range(par.ep_size)]
        return out

    def weight_shards(self, copy: bool = False, experts_only: bool = False) -> dict[str, torch.Tensor]:
        """This rank's `{megatron name: tensor}` (`copy`: clones, for callers that keep them while training goes on;
        `experts_only`: the routed experts alone, what a sender beyond the TP ranks provides)."""
        return {name: tensor.clone() if copy else tensor for name, tensor, layout in self.actor.named_shards()
                if not experts_only or layout.expert is not None}

    # ---- weight sync, shard mode (`weight_sync.senders.ShardSenders`) -------------------------------

    def join_weight_group(self, master_address: str, master_port: int, world_size: int, group_name: str,
                          backend: str, timeout_s: float, key: str | None = None, group_rank: int | None = None,
                          senders: int | None = None) -> None:
        """Join the weight-update group as `group_rank` (its sender index; default this rank's TP rank) of
        `senders` sending ranks (default the TP size), blocking until all joined."""
        from miles_lite.weight_sync.senders import RankSender

        rank = self.actor.par.tp_rank if group_rank is None else group_rank
        count = self.actor.par.tp_size if senders is None else senders
        if self.sender is None or (self.sender.index, self.sender.count) != (rank, count):
            self.leave_weight_group()
            self.sender = RankSender(rank, count)
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

    def offload(self, parts: tuple[str, ...], room: OverlapRoom | None = None) -> dict[str, float]:
        return self.actor.offload(parts, room)

    def stage_offload(self, parts: tuple[str, ...]) -> dict[str, float]:
        return self.actor.stage_offload(parts)

    def drop_staged(self, parts: tuple[str, ...]) -> None:
        self.actor.drop_staged(parts)

    def finish_offload(self) -> dict[str, float]:
        return self.actor.finish_offload()

    def onload(self, parts: tuple[str, ...]) -> dict[str, float]:
        return self.actor.onload(parts)

    def device_memory(self, parts: bool = False) -> dict[str, float]:
        return self.actor.device_memory(parts)

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
