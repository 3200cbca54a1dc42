"""The trainer role in the driver's own process (one rank): the single-machine, world-size-1 case."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from miles_lite.checkpoint.async_ckpt import SaveStats
from miles_lite.checkpoint.driver_state import DriverState
from miles_lite.cluster.rank import TrainerRank
from miles_lite.config.views import TrainerRoleConfig
from miles_lite.net.ports import LOCAL_HOST, free_port, node_address, url_host
from miles_lite.trainer.layout import ParamLayout
from miles_lite.trainer.offload import OverlapRoom
from miles_lite.types import TrainBatch


class LocalTrainer:
    """A `TrainerRole` of world size 1: one `TrainerRank` in this process."""

    def __init__(self, cfg: TrainerRoleConfig) -> None:
        self.cfg = cfg
        self.rank = TrainerRank()
        # A world of one: the process group never leaves this process.
        self.rank.setup(cfg, rank=0, world_size=1, init_method=f"tcp://{LOCAL_HOST}:{free_port(LOCAL_HOST)}",
                        total_steps=cfg.actor.steps)

    def layouts(self) -> list[ParamLayout]:
        return self.rank.layouts()

    def expert_senders(self) -> dict[int, int]:
        """Every routed expert lives on this one rank (sender 0)."""
        return {layout.expert: 0 for layout in self.layouts() if layout.expert is not None}

    def weight_shards(self) -> list[dict[str, torch.Tensor]]:
        return [self.rank.weight_shards()]

    def weight_group_endpoint(self) -> tuple[str, int]:
        """The weight-update group's rendezvous (this process is its rank 0): `cluster.advertise_address`, else
        the route toward external engines (`rollout.engine_urls`), else loopback for engines on this machine."""
        peers = [url_host(u) for u in self.cfg.engine_urls]
        return node_address(self.cfg.cluster.advertise_address, peers, fallback=LOCAL_HOST), free_port("")

    def join_weight_group(self, master_address: str, master_port: int, world_size: int, group_name: str,
                          backend: str, timeout_s: float, key: str | None = None) -> None:
        self.rank.join_weight_group(master_address, master_port, world_size, group_name, backend, timeout_s, key)

    def send_weight_bucket(self, schedules: Sequence[Any]) -> list[Any]:
        return [self.rank.send_weight_bucket(schedules[0])]

    def leave_weight_group(self) -> None:
        self.rank.leave_weight_group()

    def probe_logprobs(self, sequences: Any) -> list[list[float]]:
        probe = TrainBatch.without_rollout(sequences.sequences, sequences.prompt_lens)
        return self.rank.compute_logprobs(probe, "policy", quantized=False)

    def compute_logprobs(self, batch: TrainBatch, model: str = "policy") -> list[list[float]]:
        return self.rank.compute_logprobs(batch, model)

    def train_step(self, batch: TrainBatch, distill_coef: float | None = None) -> dict[str, float]:
        return self.rank.train_step(batch, distill_coef)

    def sft_step(self, batch: TrainBatch, lr: float | None = None) -> dict[str, float]:
        return self.rank.sft_step(batch, lr)

    def export_hf_state_dict(self) -> dict[str, torch.Tensor]:
        return self.rank.export_hf_state_dict()

    def offload(self, parts: tuple[str, ...], room: OverlapRoom | None = None) -> dict[str, float]:
        return self.rank.offload(parts, room)

    def stage_offload(self, parts: tuple[str, ...]) -> dict[str, float]:
        return self.rank.stage_offload(parts)

    def drop_staged(self, parts: tuple[str, ...]) -> None:
        self.rank.drop_staged(parts)

    def finish_offload(self) -> dict[str, float]:
        return self.rank.finish_offload()

    def onload(self, parts: tuple[str, ...]) -> dict[str, float]:
        return self.rank.onload(parts)

    def device_memory(self, parts: bool = False) -> list[dict[str, float]]:
        return [self.rank.device_memory(parts)]

    def memory_stats(self) -> dict[str, float]:
        return self.rank.memory_stats()

    def adapter_tensors(self) -> list[dict[str, torch.Tensor]]:
        return [self.rank.adapter_state()]

    def state_dicts(self) -> list[dict[str, Any]]:
        """Checkpoint state of every rank (one here)."""
        return [self.rank.state_dict()]

    def load_state_dicts(self, states: list[dict[str, Any]]) -> None:
        self.rank.load_state_dict(states[0])

    def save_checkpoint(self, step: int, driver: DriverState, final: bool = False) -> SaveStats:
        return self.rank.save_checkpoint(step, driver, final)

    def finalize_checkpoint(self) -> SaveStats | None:
        return self.rank.finalize_checkpoint()

    def restore_checkpoint(self, path: str) -> DriverState | None:
        return self.rank.restore_checkpoint(path)

    def close(self) -> None:
        self.rank.close()
