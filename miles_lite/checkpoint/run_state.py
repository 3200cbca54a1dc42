"""The per-rank checkpointer a trainer role owns: its shards (plus, on rank 0, the driver state and the
HF assets) through one `AsyncCheckpointer`, held for the whole run so that one asynchronous save stays in
flight between steps. The driver's side (what goes into `DriverState`, when to save, resuming) is in
`miles_lite/run/outputs.py`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from miles_lite.checkpoint.async_ckpt import AsyncCheckpointer, SaveStats
from miles_lite.checkpoint.driver_state import DriverState
from miles_lite.checkpoint.host_buffers import HostBuffers
from miles_lite.checkpoint.resume import CheckpointReader
from miles_lite.checkpoint.trainer_state import checkpoint_payload, hf_assets, restore_actor, snapshot_sizes
from miles_lite.config.schema import CheckpointConfig, ModelConfig


def tokenizer_dir(model: ModelConfig) -> Path | None:
    """Where the run's tokenizer files are: `model.tokenizer_path`, else `model.hf_path`, else None."""
    for candidate in (model.tokenizer_path, model.hf_path):
        if candidate and Path(candidate).is_dir():
            return Path(candidate)
    return None


class RankCheckpointer:
    """Checkpoints of one trainer rank's `TrainerActor` (plus, on rank 0, the driver state and HF assets).

    The `AsyncCheckpointer` is made on the first save (every rank saves together) and held for the run.

    Args:
        checkpoint: `checkpoint.*` of the run.
        model: `model.*` of the run (where the HF assets stored with rank 0's checkpoint come from).
        timeout_s: how long a rank waits for the others while flushing.
    """

    def __init__(self, checkpoint: CheckpointConfig, model: ModelConfig, timeout_s: float = 1800.0,
                 buffers: HostBuffers | None = None) -> None:
        self.checkpoint = checkpoint
        self.model = model
        self.timeout_s = timeout_s
        self.buffers = buffers
        self.saver: AsyncCheckpointer | None = None

    def prepare(self, actor: Any, staged: bool = False) -> None:
        """At trainer start-up, when the run saves asynchronously every `checkpoint.interval` steps:
        start allocating the snapshots' host buffers on a background thread, so that the first save
        blocks training only for its copies (allocating ~7 GB of pinned memory takes seconds). Not when
        `staged`: the saves write the host copies the actor's offload stages (`saves_staged_copies`)."""
        ckpt = self.checkpoint
        if self.buffers is None and ckpt.async_save and ckpt.interval > 0 and not staged:
            self.buffers = HostBuffers()
            self.buffers.reserve(snapshot_sizes(actor))

    def save(self, actor: Any, step: int, driver: DriverState | None = None) -> SaveStats:
        """Snapshot `actor` (and `driver` on rank 0) as checkpoint `step`; returns once training may go on. The
        tensors whose bytes the actor's offload has staged in host memory are written from those copies."""
        if self.saver is None:
            self.saver = AsyncCheckpointer.from_config(self.checkpoint, timeout_s=self.timeout_s,
                                                       buffers=self.buffers)
        rank0 = self.saver.rank == 0
        assets = hf_assets(actor.hf_config, tokenizer_dir(self.model)) if rank0 else None
        meta = driver.manifest_meta() if rank0 and driver is not None else None
        payload = checkpoint_payload(actor, driver.to_tree() if rank0 and driver is not None else None,
                                     assets=assets, meta=meta)
        # What a colocated trainer staged for its offload is this state's bytes already (`run/handoff.py`).
        return self.saver.save(step, payload, actor.offloader.staged_copies())

    def finalize(self) -> SaveStats | None:
        """Wait for the save in flight; its completed stats (None when nothing was saved)."""
        return self.saver.finalize() if self.saver is not None else None

    def close(self) -> None:
        if self.saver is not None:
            self.saver.close()
        elif self.buffers is not None:
            self.buffers.clear()

    @staticmethod
    def restore(actor: Any, path: str | Path) -> DriverState | None:
        """Load checkpoint `path` into `actor` (verifying checksums); the driver state it holds, if any."""
        reader = CheckpointReader(path)
        try:
            shared = restore_actor(actor, reader)
        finally:
            reader.close()
        tree = shared.get("driver")
        return DriverState.from_tree(tree) if tree is not None else None
