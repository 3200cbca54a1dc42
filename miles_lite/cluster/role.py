"""`TrainerRole`: what the driver, weight sync and checkpoints call on the trainer, wherever its ranks run.

Two implementations: `LocalTrainer` (one rank in the driver's process) and `RayTrainerGroup` (one
Ray actor per rank in the trainer gang). Both forward to `TrainerRank`, the per-rank body.
"""

from __future__ import annotations

from typing import Protocol

import torch

from miles_lite.checkpoint.async_ckpt import SaveStats
from miles_lite.checkpoint.driver_state import DriverState
from miles_lite.trainer.offload import OverlapRoom
from miles_lite.types import TrainBatch
from miles_lite.weight_sync.senders import WeightSource


class TrainerRole(WeightSource, Protocol):
    """The trainer as one object: compute, steps, checkpoints (plus `WeightSource` for weight sync)."""

    def compute_logprobs(self, batch: TrainBatch, model: str = "policy") -> list[list[float]]:
        """Per sequence, logprobs (nats) of its response tokens under `model` (policy | reference | teacher)."""

    def train_step(self, batch: TrainBatch, distill_coef: float | None = None) -> dict[str, float]:
        """RL optimizer steps over the whole batch (split over data-parallel ranks); float stats.
        `distill_coef`: the distillation weight of this batch (None: `algo.distill_coef`)."""

    def sft_step(self, batch: TrainBatch, lr: float | None = None) -> dict[str, float]:
        """One supervised step on the response tokens (`lr` None: the RL schedule's current LR)."""

    def export_hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Full HF tensors gathered over TP (on CPU)."""

    def save_checkpoint(self, step: int, driver: DriverState, final: bool = False) -> SaveStats:
        """Every rank snapshots its shards (rank 0 adds `driver` and commits); `final` waits for the commit."""

    def finalize_checkpoint(self) -> SaveStats | None:
        """Wait for the save in flight to commit; its stats (None when nothing was saved)."""

    def restore_checkpoint(self, path: str) -> DriverState | None:
        """Load checkpoint `path` on every rank (resharding to this TP/DP); the driver state it holds."""

    def offload(self, parts: tuple[str, ...], room: OverlapRoom | None = None) -> dict[str, float]:
        """Move `parts` (params, grads, optimizer) of every rank's state to host memory; rank 0's bytes and seconds.
        With `room`, each rank whose device keeps that room leaves the copies of the parts it keeps in flight (see
        `trainer/offload.py`); `deferred` is 1.0 when any rank did, and `finish_offload` must then follow."""

    def stage_offload(self, parts: tuple[str, ...]) -> dict[str, float]:
        """Every rank copies `parts` to host memory ahead of their offload and keeps them on the device until it
        (see `trainer/offload.py`: a write drops the copies); rank 0's bytes and seconds."""

    def drop_staged(self, parts: tuple[str, ...]) -> None:
        """Every rank forgets the copies `stage_offload` made of `parts` (no offload will take them); its device's
        later work waits for those copies first."""

    def finish_offload(self) -> dict[str, float]:
        """Every rank waits for the copies its offload left in flight and frees their memory; rank 0's seconds."""

    def onload(self, parts: tuple[str, ...]) -> dict[str, float]:
        """Bring offloaded `parts` back to every rank's device; rank 0's seconds and `<part>_bytes` of each part
        it moved (a resident part has none)."""

    def device_memory(self, parts: bool = False) -> list[dict[str, float]]:
        """Every rank's device memory, in rank order: free and total bytes (with `parts`, after its cached blocks
        went back to the driver, also the bytes of its parameters and optimizer state resident now); an empty
        dict for a rank on a CPU."""

    def memory_stats(self) -> dict[str, float]:
        """Rank 0's trainer state in compute memory (and on a GPU its peak since the last call, device use)."""

    def close(self) -> None:
        """Leave the weight group, finish checkpoints, release the ranks (idempotent)."""
