"""Trainer ranks as members of the weight-update group (shard mode).

`ShardSenders` is what the distributed transport needs from the trainer role: every weight sender (the
trainer TP ranks of data-parallel rank 0, then, with expert parallelism, one rank of each expert-parallel
rank they miss: `plan` module docstring) joins the group (as group rank = its sender index) and, per
bucket, sends the blocks it holds. `LocalTrainer` (in-process) and `RayTrainerGroup` (one actor per rank) implement it
on top of one `RankSender` per rank.

RankSender lifecycle: IDLE -> JOINED (join) -> IDLE (leave); a failed join or send leaves it IDLE
with the group destroyed, so the next `connect` starts clean. The join returns once the group formed:
TP rank 0 hosts its store and closes it then, after every rank ran one send of each trainer-to-engine
pair (`WarmUp`), which creates every communicator the pushes use.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

from miles_lite.trainer.layout import ParamLayout
from miles_lite.weight_sync.shard_protocol import RankSchedule, SendStats, send_bucket
from miles_lite.weight_sync.weight_group import WarmUp, init_custom_process_group


class ShardSenders(Protocol):
    """The trainer ranks holding the weights, seen from the transport (index = sender: TP rank, then expert
    holders)."""

    def weight_group_endpoint(self) -> tuple[str, int]:
        """(address, port) of the group's rendezvous: trainer TP rank 0's node address and a port free there."""

    def join_weight_group(self, master_address: str, master_port: int, world_size: int, group_name: str,
                          backend: str, timeout_s: float, key: str | None = None) -> None:
        """Every sender joins the group as rank = its sender index, presenting `key`; returns once all joined."""

    def send_weight_bucket(self, schedules: Sequence[RankSchedule]) -> list[SendStats]:
        """Sender t sends `schedules[t]` from its live parameters; returns once every send completed."""

    def leave_weight_group(self) -> None:
        """Every sender destroys its membership (idempotent)."""


class WeightSource(ShardSenders, Protocol):
    """What weight sync needs of a trainer role: its layouts, its shards and probe logprobs (plus, for the
    shard mode, the `ShardSenders` calls)."""

    def layouts(self) -> list[ParamLayout]:
        """Parameter layouts of TP rank 0 (they describe every rank's sharding), with one layout per routed expert
        of every expert-parallel rank."""

    def expert_senders(self) -> dict[int, int]:
        """Global routed expert -> the sender holding it (empty for a dense model)."""

    def weight_shards(self) -> list[dict[str, torch.Tensor]]:
        """`{megatron name: local tensor}` per sender (index = sender; TP ranks first)."""

    def probe_logprobs(self, sequences: Any) -> list[list[float]]:
        """Logprobs (nats) of each probe sequence's tokens after its prompt, under the current weights."""

    def adapter_tensors(self) -> list[dict[str, torch.Tensor]]:
        """LoRA: `[{PEFT name: full adapter tensor}]` (the one entry gathered over TP)."""


class SenderState(enum.Enum):
    IDLE = "idle"
    JOINED = "joined"


class RankSender:
    """One trainer rank's membership in the weight-update group."""

    def __init__(self, index: int, count: int = 1) -> None:
        """`index`: this rank's sender index = its group rank (its TP rank, or past the TP ranks for an expert
        holder); `count`: the group's sending ranks 0..count-1 (the trainer's TP size and the expert holders)."""
        if not 0 <= index < count:
            raise ValueError(f"trainer sender {index} is outside [0, {count}) (the group's sending ranks)")
        self.index = index
        self.count = count
        self.state = SenderState.IDLE
        self.group: dist.ProcessGroup | None = None
        self.group_name = ""

    def join(self, master_address: str, master_port: int, world_size: int, group_name: str, backend: str,
             timeout_s: float, key: str | None = None) -> None:
        """Join `group_name` as group rank `index` (blocks until every member joined); leaves a previous group."""
        self.leave()
        self.group = init_custom_process_group(backend, master_address, master_port, self.index, world_size,
                                               group_name, timeout_s, key=key, warm_up=WarmUp(senders=self.count))
        self.group_name = group_name
        self.state = SenderState.JOINED

    def send(self, shards: Mapping[str, torch.Tensor], schedule: RankSchedule) -> SendStats:
        """Send this rank's part of one bucket from its local tensors `shards` ({megatron name: tensor})."""
        if self.state is not SenderState.JOINED or self.group is None:
            raise RuntimeError(f"trainer sender {self.index} is not in a weight-update group; join first")
        try:
            return send_bucket(self.group, shards, schedule)
        except Exception:
            self.leave()
            raise

    def leave(self) -> None:
        """Destroy the membership (idempotent)."""
        if self.group is not None:
            dist.destroy_process_group(self.group)
        self.group = None
        self.group_name = ""
        self.state = SenderState.IDLE
