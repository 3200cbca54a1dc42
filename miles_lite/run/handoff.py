"""Colocated roles handing the device to each other (`cluster.placement=colocated`, `colocated_memory=handoff`).

Who holds the device is a state machine:

    both ──for_generation──> engines ──for_training──> trainer ──push──> engines
      └──────────────────────for_training─────────────────────┘

- `both`: both roles loaded (colocated resident runs); a hand-off run starts in `engines`, the trainer's
  state offloaded before the engines started (`System.start`), so they start into the room;
- `for_generation`: the trainer offloads `trainer.offload.*` to host memory (`time/offload_seconds`);
- `for_training`: the engines release weights, KV cache and CUDA graphs (`time/engine_sleep_seconds`),
  then the trainer onloads (`time/onload_seconds`: on a GPU the time to queue the copies; they run on a stream
  of their own while the step starts, the optimizer state landing before the optimizer step reads it). Runs
  that push only LoRA adapters keep the engines' weights: their base never changes, and SGLang's memory saver
  drops released weights (no host copy), so an adapter-only push after the wake would leave the engine
  computing with garbage;
- `push`: the trainer drops its gradient buffers and offloads its optimizer state, the push resumes the engines'
  weights, loads the new version and resumes their KV cache (`time/engine_wake_seconds`) before the probe
  verification; then the trainer offloads its parameters. The parameters stay on the device through the
  push because the push reads them and the verification scores the probe with them.

With `colocated_memory=resident` (or disaggregated placement) every transition is a no-op and `push` is a
plain weight push, so the driver runs one loop for all placements. Each step also reports the memory per
phase (`memory/<phase>_*`, see `TrainerRole.memory_stats`) when the roles are colocated.
"""

from __future__ import annotations

import enum
import time
from typing import Any

from miles_lite.config.colocation import hands_off
from miles_lite.config.lora_serving import serves_adapters
from miles_lite.config.offload import OFFLOAD_PARTS
from miles_lite.rollout.engine import MEMORY_TAGS
from miles_lite.run.system import System
from miles_lite.weight_sync.coordinator import SyncReport


class Holder(enum.Enum):
    BOTH = "both"
    ENGINES = "engines"
    TRAINER = "trainer"


class Handoff:
    """The device hand-over of one run (see the module docstring); `stats()` gives this step's seconds."""

    def __init__(self, system: System) -> None:
        self.system = system
        self.enabled = hands_off(system.cfg)
        self.colocated = system.cfg.cluster.placement == "colocated"
        self.parts = system.cfg.trainer.offload.parts()
        # What the engines release to sleep (see the module docstring on adapter-only pushes).
        adapters_only = serves_adapters(system.cfg)
        self.sleep_tags = tuple(t for t in MEMORY_TAGS if t != "weights") if adapters_only else MEMORY_TAGS
        # The engines started while the trainer's state waited in host memory (`System.start`).
        self.holder = Holder.ENGINES if self.enabled and system.offloaded_at_start else Holder.BOTH
        self._seconds: dict[str, float] = {}
        self._memory: dict[str, float] = {}

    def _add(self, name: str, seconds: float) -> None:
        self._seconds[name] = self._seconds.get(name, 0.0) + seconds

    def _offload(self, parts: tuple[str, ...]) -> None:
        assert self.system.trainer is not None
        if parts:
            self._add("offload", self.system.trainer.offload(parts)["seconds"])

    def for_generation(self) -> None:
        """Before generating: the trainer's state off the device (nothing when the engines hold it already)."""
        if self.enabled and self.holder is not Holder.ENGINES:
            if self.holder is Holder.TRAINER:
                raise RuntimeError("the engines sleep: only a weight push (Handoff.push) wakes them")
            self._offload(self.parts)
            self.holder = Holder.ENGINES

    def for_training(self) -> None:
        """Before training (or a checkpoint): the engines asleep, the trainer's state back on the device."""
        if not self.enabled or self.holder is Holder.TRAINER:
            return
        assert self.system.fleet is not None and self.system.loop_thread is not None and self.system.trainer
        start = time.perf_counter()
        self.system.loop_thread.run(self.system.fleet.sleep(self.sleep_tags))
        self._add("engine_sleep", time.perf_counter() - start)
        self._add("onload", self.system.trainer.onload(OFFLOAD_PARTS)["seconds"])
        self.holder = Holder.TRAINER

    def push(self, version: int) -> tuple[SyncReport, float]:
        """Push the trainer's weights as `version` (`System.push_weights`), handing the device to the engines
        around it; the report and the push's wall seconds (the trainer's offloads are not in them)."""
        assert self.system.pusher is not None
        if not self.enabled:
            return self.system.push_weights(version)
        self.for_training()  # a push from `both` (warm-up, resume) puts the engines to sleep first
        self._offload(tuple(p for p in self.parts if p != "params"))
        report, seconds = self.system.push_weights(version)
        self._add("engine_wake", self.system.pusher.wake_seconds)
        self._offload(tuple(p for p in self.parts if p == "params"))
        self.holder = Holder.ENGINES
        return report, seconds

    def measure(self, phase: str) -> None:
        """Record the memory at the end of `phase` (colocated runs only)."""
        if self.colocated and self.system.trainer is not None:
            for key, value in self.system.trainer.memory_stats().items():
                self._memory[f"memory/{phase}_{key}"] = value

    def stats(self) -> dict[str, Any]:
        """This step's transition seconds (`time/<transition>_seconds`) and memory per phase; then reset."""
        out: dict[str, Any] = {f"time/{k}_seconds": v for k, v in self._seconds.items()}
        out.update(self._memory)
        self._seconds, self._memory = {}, {}
        return out
