"""The trainer actor's state to host memory and back while colocated engines use the device (`TrainerActor`
takes these methods; the mechanics are `trainer/offload.py`'s)."""

from __future__ import annotations

from typing import Any

from miles_lite.config.offload import OFFLOAD_PARTS
from miles_lite.trainer.offload import OverlapRoom, device_memory, memory_stats


class ActorOffload:
    """Offload calls of `TrainerActor` (a mixin over its offloader and device)."""

    # Provided by TrainerActor.
    policy: Any
    offloader: Any
    _require_ready: Any

    def offload(self, parts: tuple[str, ...] = OFFLOAD_PARTS, room: OverlapRoom | None = None) -> dict[str, float]:
        """Move `parts` of the trainer's state to host memory (see `trainer/offload.py`); bytes and seconds. With
        `room`, the copies may stay in flight while the device keeps that room (`deferred`; `finish_offload`)."""
        self._require_ready()
        keep_free = room.bytes_needed(self.offloader.part_bytes("params")) if room is not None else 0
        return self.offloader.offload(parts, wait=room is None, keep_free=keep_free).report()

    def stage_offload(self, parts: tuple[str, ...]) -> dict[str, float]:
        """Copy `parts` to host memory ahead of their offload, leaving them on the device (`TrainerOffload.stage`);
        bytes and seconds."""
        self._require_ready()
        return self.offloader.stage(parts).report()

    def drop_staged(self, parts: tuple[str, ...]) -> None:
        """Forget the copies `stage_offload` made of `parts` (`TrainerOffload.drop_staged`)."""
        self._require_ready()
        self.offloader.drop_staged(parts)

    def finish_offload(self) -> dict[str, float]:
        """Wait for the copies an offload left in flight and free their device memory; seconds."""
        self._require_ready()
        return {"seconds": self.offloader.settle()}

    def onload(self, parts: tuple[str, ...] = OFFLOAD_PARTS) -> dict[str, float]:
        """Bring offloaded `parts` back to the device; bytes and seconds."""
        self._require_ready()
        return self.offloader.onload(parts).report()

    def device_memory(self, parts: bool = False) -> dict[str, float]:
        """This rank's device memory, free and total (with `parts`, also the bytes of the parts a checkpoint holds
        resident now); nothing on a CPU (`offload.device_memory`)."""
        self._require_ready()
        return device_memory(self.offloader, self.policy.device, parts)

    def memory_stats(self, reset_peak: bool = True) -> dict[str, float]:
        """Trainer state in compute memory; on a GPU also the peak allocation since the last call (`offload.py`)."""
        return memory_stats(self.offloader, self.policy.device, reset_peak)
