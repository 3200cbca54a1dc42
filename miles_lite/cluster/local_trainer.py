"""The trainer role in the driver's own process (one rank): the single-machine, world-size-1 case."""

from __future__ import annotations

from typing import Any

import torch

from miles_lite.checkpoint.run_state import ActorCheckpoints
from miles_lite.config.schema import MilesConfig
from miles_lite.ports import LOCAL_HOST, free_port, node_address, url_host
from miles_lite.trainer.layout import ParamLayout
from miles_lite.types import TrainBatch


class LocalTrainer:
    """A `TrainerActor` of world size 1 with the calls the driver and weight sync make."""

    def __init__(self, cfg: MilesConfig) -> None:
        from miles_lite.trainer.actor import TrainerActor

        # A world of one: the process group never leaves this process.
        self.actor = TrainerActor(cfg, rank=0, world_size=1, init_method=f"tcp://{LOCAL_HOST}:{free_port(LOCAL_HOST)}",
                                  total_steps=max(cfg.experiment.steps, 1))
        self.cfg = cfg
        self.checkpoints = ActorCheckpoints()
        self.checkpoints.prepare(self.actor, cfg)
        self.sender: Any = None

    def layouts(self) -> list[ParamLayout]:
        """Parameter layouts of TP rank 0 (they describe every rank's sharding)."""
        return list(self.actor.layouts.values())

    def weight_shards(self) -> list[dict[str, torch.Tensor]]:
        """`{megatron name: local tensor}` per trainer TP rank (one rank here)."""
        return [{name: tensor for name, tensor, _ in self.actor.named_shards()}]

    # ---- weight sync, shard mode (`weight_sync.senders.ShardSenders`) -----------------------------

    def weight_group_endpoint(self) -> tuple[str, int]:
        """The weight-update group's rendezvous (this process is its rank 0): `cluster.advertise_address`, else
        the route toward external engines (`rollout.engine_urls`), else loopback for engines on this machine."""
        peers = [url_host(u) for u in self.cfg.rollout.engine_urls]
        return node_address(self.cfg.cluster.advertise_address, peers, fallback=LOCAL_HOST), free_port("")

    def join_weight_group(self, master_address: str, master_port: int, world_size: int, group_name: str,
                          backend: str, timeout_s: float) -> None:
        """Join the weight-update group as its rank 0 (the only TP rank); blocks until every rank joined."""
        from miles_lite.weight_sync.senders import RankSender

        if self.sender is None:
            self.sender = RankSender(tp_rank=0)
        self.sender.join(master_address, master_port, world_size, group_name, backend, timeout_s)

    def send_weight_bucket(self, schedules: Any) -> list[Any]:
        """Send `schedules[0]` (this rank's part of one bucket) from the live parameters; its `SendStats`."""
        shards = {name: tensor for name, tensor, _ in self.actor.named_shards()}
        return [self.sender.send(shards, schedules[0])]

    def leave_weight_group(self) -> None:
        if self.sender is not None:
            self.sender.leave()

    def probe_logprobs(self, sequences: Any) -> list[list[float]]:
        """Logprobs of each probe sequence's tokens after its prompt (nats), under the current weights."""
        probe = TrainBatch.without_rollout(sequences.sequences, sequences.prompt_lens)
        return self.actor.compute_logprobs(probe, quantized=False)

    def compute_logprobs(self, batch: TrainBatch, model: str = "policy") -> list[list[float]]:
        return self.actor.compute_logprobs(batch, model)

    def train_step(self, batch: TrainBatch, distill_coef: float | None = None) -> dict[str, float]:
        return self.actor.train_step(batch, distill_coef)

    def sft_step(self, batch: TrainBatch, lr: float | None = None) -> dict[str, float]:
        return self.actor.sft_step(batch, lr)

    def state_dicts(self) -> list[dict[str, Any]]:
        """Checkpoint state of every rank (one here)."""
        return [self.actor.state_dict_for_checkpoint()]

    def load_state_dicts(self, states: list[dict[str, Any]]) -> None:
        self.actor.load_checkpoint_state(states[0])

    def save_checkpoint(self, cfg: MilesConfig, step: int, driver: Any, final: bool = False) -> Any:
        """Snapshot the shards and `driver` state as checkpoint `step`; `final` waits for the commit."""
        return self.checkpoints.save(self.actor, cfg, step, driver, final)

    def finalize_checkpoint(self) -> Any:
        """Wait for the save in flight to commit; its `SaveStats` (None when nothing was saved)."""
        return self.checkpoints.finalize()

    def restore_checkpoint(self, path: str) -> Any:
        """Load checkpoint `path` (any TP/DP it was saved with); the driver state it holds, if any."""
        return self.checkpoints.restore(self.actor, path)

    def close(self) -> None:
        self.leave_weight_group()
        self.checkpoints.close()
        self.actor.close()
