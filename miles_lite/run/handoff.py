"""Colocated roles handing the device to each other (`cluster.placement=colocated`, `colocated_memory=handoff`).

Who holds the device is a state machine:

    both ──for_generation──> engines ──sleep_engines──> handing over ──for_training──> trainer ──push──> engines
      └──────────────────────────────────for_training (the sleep then)─────────────────────┘

- `both`: both roles loaded (colocated resident runs); a hand-off run starts in `engines`, the trainer's
  state offloaded before the engines started (`System.start`), so they start into the room;
- `for_generation`: the trainer offloads `trainer.offload.*` to host memory (`time/offload_seconds`);
- `sleep_engines` (once the step's generation and evaluation are done): the engines start releasing weights, KV
  cache and CUDA graphs (`time/engine_sleep_seconds`) while the rewards are scored and the batch is built;
- `for_training`: waits for that sleep (starts it, when nothing did), then the trainer onloads
  (`time/onload_seconds`: on a GPU the time to queue the copies; they run on a stream of their own while the step
  starts, the optimizer state landing before the optimizer step reads it). Runs
  that push only LoRA adapters keep the engines' weights: their base never changes, and SGLang's memory saver
  drops released weights (no host copy), so an adapter-only push after the wake would leave the engine
  computing with garbage;
- `push`: once the step's optimizer step is done (`prepare_push`, before a checkpoint) the trainer frees its
  gradient buffers, scores the push's probe (`sync/phase_probe_trainer_seconds`), and queues the copies of its
  optimizer state, then of its parameters, to host memory while both stay on the device; a checkpoint saved then
  writes those copies instead of copying the same bytes again. The push offloads the optimizer state (its copies
  taken), resumes the engines' weights, loads the new version and resumes their KV cache
  (`time/engine_wake_seconds`) before the engines' side of the probe verification; then the trainer offloads its
  parameters (their copies taken). The parameters stay on the device through the push because the push reads them.
  The optimizer state's copies overlap the push where the device has room: they run while the engines resume their
  weights and load the new version, and are waited for (their memory freed) just before the engines resume their KV
  cache, which needs that memory (`time/offload_overlapped`: 1.0 when they did). The room is `overlap_room`'s bound
  on the weights the engines resume on a trainer device, checked by each trainer rank against its free device
  memory once the gradients are freed; a rank without it waits for the copies and frees the optimizer state before
  the push. `time/offload_seconds` counts the host time of every offload call, the wait for those copies included.
- `trainer.offload.when=needed` moves the parameters and optimizer state only as far as the engines need: each
  rank reads its free device memory before and after the engines sleep (what they take back when they wake; the
  most seen), and `prepare_push`, once the gradients are freed, picks the parts that leave (`parts_leaving`: the
  optimizer state, then the parameters, until the engines' share and `SPARE_FRACTION` of the device fit). What stays
  needs no onload, and is copied only for a checkpoint: on a step that saves one it is staged like the rest, so the
  save writes those copies, and the push drops them. Where every kept part stays, the engines' room is free as
  soon as the gradients are: their weights resume then, under the trainer's probe scoring and the checkpoint,
  and the push finds them resumed (`wake_weights` is then the wait for that resume). The engines still start
  into the room (`System.start` offloads every part first), so they size their pools as with `always`.

With `colocated_memory=resident` (or disaggregated placement) every transition is a no-op and `push` is a
plain weight push, so the driver runs one loop for all placements. Each step also reports the memory per
phase (`memory/<phase>_*`, see `TrainerRole.memory_stats`) when the roles are colocated.
"""

from __future__ import annotations

import enum
import logging
import math
import time
from collections.abc import Awaitable
from concurrent.futures import Future
from typing import Any

from miles_lite.config.colocation import hands_off
from miles_lite.config.lora_serving import serves_adapters
from miles_lite.config.offload import DROPPED_PARTS, KEPT_PARTS, OFFLOAD_PARTS
from miles_lite.config.schema import MilesConfig
from miles_lite.rollout.engine import MEMORY_TAGS
from miles_lite.run.system import System
from miles_lite.trainer.offload import OverlapRoom
from miles_lite.weight_sync.coordinator import SyncReport

logger = logging.getLogger(__name__)


# With `trainer.offload.when=needed`: the share of a device's memory left free beside the woken engines for what
# they allocate outside the pools they release asleep (logits, sampling buffers, prefill activations).
SPARE_FRACTION = 1 / 8
# The order kept parts leave in when the engines need room: the optimizer state first (the push never reads it),
# then the parameters.
LEAVING_ORDER = ("optimizer", "params")


def parts_leaving(parts: tuple[str, ...], ranks: list[dict[str, float]],
                  engines: list[float] | None) -> tuple[str, ...]:
    """With `trainer.offload.when=needed`: which of the kept `parts` (`KEPT_PARTS`) leave the device this step.

    Per rank (`ranks`: each one's `device_memory(parts=True)` now, the engines asleep), the engines take back
    `engines[rank]` bytes when they wake (what they freed when they went to sleep) and `SPARE_FRACTION` of the
    device stays free beside them; parts leave in `LEAVING_ORDER` until the rest fits. Every rank moves what any
    rank needs moved (one plan for the gang). A rank without a measure (a CPU, or engines never seen asleep yet)
    moves them all."""
    kept = [p for p in LEAVING_ORDER if p in parts]
    if engines is None or len(engines) != len(ranks) or any("free_bytes" not in r for r in ranks):
        return tuple(p for p in parts if p in kept)
    leaving: set[str] = set()
    for room, need in zip(ranks, engines, strict=True):
        short = need + SPARE_FRACTION * room["total_bytes"] - room["free_bytes"]
        for part in kept:
            if short <= 0:
                break
            leaving.add(part)
            short -= room.get(f"{part}_bytes", 0.0)
    return tuple(p for p in parts if p in leaving)


async def _seconds_of(transition: Awaitable[None]) -> float:
    """The seconds an engines' transition takes, run on the rollout loop while the driver goes on."""
    start = time.perf_counter()
    await transition
    return time.perf_counter() - start


class Holder(enum.Enum):
    BOTH = "both"
    ENGINES = "engines"
    HANDING_OVER = "handing over"  # the engines going to sleep (`sleep_engines`), the trainer not back yet
    TRAINER = "trainer"


def overlap_room(cfg: MilesConfig, weights_resumed: bool) -> OverlapRoom:
    """What a trainer device must keep free for its optimizer offload to overlap a push (see the module docstring).

    A bound, not an estimate. A trainer rank holds at least 1/(tp * pp * ep) of the model's weights, so the model
    is at most that many times its resident parameters (fewer bytes still where the trainer keeps fp32 weights
    and the engines serve bf16). An engine holds 1/engine_tp of the model on each device it spans, and one device
    holds a rank of at most every engine, or of ceil(engines / trainer ranks) engines per device an engine spans
    (engines start round-robin over the trainer's devices), whichever is fewer: no even spread is assumed.
    Engines that keep their weights asleep (adapter-only pushes) resume none. The push stages up to two buckets
    on the trainer's side (one filling, one in flight).
    """
    trainer, rollout = cfg.trainer, cfg.rollout
    ranks = min(rollout.engines, math.ceil(rollout.engines / trainer.world_size) * rollout.engine_tp)
    scale = trainer.tp * trainer.pp * trainer.ep * ranks / rollout.engine_tp if weights_resumed else 0.0
    return OverlapRoom(weights_scale=scale, staging_bytes=(2 * cfg.weight_sync.bucket_mib) << 20)


class Handoff:
    """The device hand-over of one run (see the module docstring); `stats()` gives this step's seconds."""

    def __init__(self, system: System) -> None:
        self.system = system
        self.enabled = hands_off(system.cfg)
        self.colocated = system.cfg.cluster.placement == "colocated"
        self.parts = system.cfg.trainer.offload.parts()
        # `trainer.offload.when=needed`: the parameters and optimizer state leave only as far as the engines need.
        self.as_needed = system.cfg.trainer.offload.when == "needed"
        # Per trainer rank: the most device memory the engines freed going to sleep (None: not measured yet).
        self._engines_bytes: list[float] | None = None
        # The parts that leave at this step's push (`prepare_push`): `parts`, less what stays as `as_needed` allows.
        self._moving = self.parts
        # What the engines release to sleep (see the module docstring on adapter-only pushes).
        adapters_only = serves_adapters(system.cfg)
        self.sleep_tags = tuple(t for t in MEMORY_TAGS if t != "weights") if adapters_only else MEMORY_TAGS
        self.room = overlap_room(system.cfg, weights_resumed="weights" in self.sleep_tags)
        # Whether trainer ranks have offload copies in flight that must finish before the engines' KV cache wakes.
        self._leaving = False
        # The engines started while the trainer's state waited in host memory (`System.start`).
        self.holder = Holder.ENGINES if self.enabled and system.offloaded_at_start else Holder.BOTH
        self._seconds: dict[str, float] = {}
        self._overlapped: float | None = None  # this step's `time/offload_overlapped`, once its push offloaded
        self._memory: dict[str, float] = {}
        # The version `prepare_push` scored the trainer's probe for, and the seconds it took.
        self._probe: tuple[int, float] | None = None
        # The engines' weights resuming since `prepare_push` (`_wake_weights_early`): the seconds it takes.
        self._waking: Future[float] | None = None
        # The parts staying on the device that `prepare_push` staged for a save (dropped once the push is done).
        self._staged_for_save: tuple[str, ...] = ()
        # The engines' sleep since `sleep_engines`: the trainer's device memory read before it (with
        # `trainer.offload.when=needed`) and the sleep's seconds.
        self._sleeping: tuple[list[dict[str, float]] | None, Future[float]] | None = None

    def _add(self, name: str, seconds: float) -> None:
        self._seconds[name] = self._seconds.get(name, 0.0) + seconds

    def _offload(self, parts: tuple[str, ...], room: OverlapRoom | None = None) -> dict[str, float]:
        """Offload `parts` (timed); with `room`, their copies may stay in flight (the answer's `deferred`)."""
        assert self.system.trainer is not None
        if not parts:
            return {}
        moved = self.system.trainer.offload(parts, room)
        self._add("offload", moved["seconds"])
        return moved

    def for_generation(self) -> None:
        """Before generating: the trainer's state off the device (nothing when the engines hold it already)."""
        if self.enabled and self.holder is not Holder.ENGINES:
            if self.holder in (Holder.TRAINER, Holder.HANDING_OVER):
                raise RuntimeError("the engines sleep: only a weight push (Handoff.push) wakes them")
            self._offload(self.parts)
            self.holder = Holder.ENGINES

    def sleep_engines(self) -> None:
        """Once the step's generation (and evaluation) is done: the engines start going to sleep on the rollout
        loop, so they sleep while the rewards are scored and the batch is built; `for_training` waits for it."""
        if not self.enabled or self.holder not in (Holder.ENGINES, Holder.BOTH):
            return
        assert self.system.fleet is not None and self.system.loop_thread is not None and self.system.trainer
        awake = self.system.trainer.device_memory() if self.as_needed else None
        self._sleeping = (awake, self.system.loop_thread.submit(_seconds_of(self.system.fleet.sleep(self.sleep_tags))))
        self.holder = Holder.HANDING_OVER

    def for_training(self) -> None:
        """Before training (or a checkpoint): the engines asleep (the sleep `sleep_engines` started, else one now),
        the trainer's state back on the device."""
        if not self.enabled or self.holder is Holder.TRAINER:
            return
        self.sleep_engines()
        assert self._sleeping is not None and self.system.trainer is not None
        (awake, sleeping), self._sleeping = self._sleeping, None
        self._add("engine_sleep", sleeping.result())
        if awake is not None:
            self._measure_engines(awake, self.system.trainer.device_memory())
        self._add("onload", self.system.trainer.onload(OFFLOAD_PARTS)["seconds"])
        self.holder = Holder.TRAINER

    def prepare_push(self, version: int, saving: bool = False) -> None:
        """Once the trainer's state for `version` is final (after its optimizer step, before a checkpoint): the
        trainer's probe scores for the push, then the offload's copies of its state queued while it stays on the
        device. A checkpoint saved now writes those copies rather than copying the same bytes again (on a GPU
        its own copies queued ahead of the push's doubled the offload's wait); the push takes them. `saving`: a
        checkpoint is saved before the push, so the parts that stay on the device (`trainer.offload.when=needed`)
        are staged too: the save writes those copies, made on the offload's stream, where its own would be queued
        on the compute stream ahead of the push's reads (0.065 s more `load` on the 0.5B's saving steps on one
        H100); the push drops them (`_drop_staged_for_save`)."""
        if not self.enabled:
            return
        assert self.system.sync is not None and self.system.trainer is not None
        self.for_training()
        # The gradients freed before any copy is queued: handing freed memory back to the driver waits for
        # every stream's work, the copies' included (0.1 s of the 0.5B's push on one H100).
        self._offload(tuple(p for p in self.parts if p in DROPPED_PARTS))
        self._moving = self._plan()
        self._wake_weights_early()
        # The trainer's side of the push's verification, before any copy is queued too: its read-back would wait
        # behind them in the device-to-host queue (0.12 s for the 0.5B's 7 GB on one H100).
        self._probe = (version, self.system.sync.score_trainer_probe(str(version)))
        # The optimizer state's copies first: the engines' KV wake waits for them alone (`_finish_offload`).
        staying = tuple(p for p in self.parts if p in KEPT_PARTS and p not in self._moving)
        self._staged_for_save = staying if saving else ()
        for parts in (self._kept_before_push(), tuple(p for p in self._moving if p == "params"), self._staged_for_save):
            if parts:
                self._add("offload", self.system.trainer.stage_offload(parts)["seconds"])

    def _wake_weights_early(self) -> None:
        """With `trainer.offload.when=needed`, once the plan keeps every kept part on the device (so the engines'
        share fits beside it now): the engines' weights start resuming, on the rollout loop, while the trainer
        scores the probe and saves; `push` waits for them. Their KV cache still wakes after the load."""
        if (not self.as_needed or self._engines_bytes is None or "weights" not in self.sleep_tags
                or any(p in KEPT_PARTS for p in self._moving)):
            return
        assert self.system.fleet is not None and self.system.loop_thread is not None
        self._waking = self.system.loop_thread.submit(_seconds_of(self.system.fleet.wake(["weights"])))

    def _kept_before_push(self) -> tuple[str, ...]:
        """The parts whose copies the push's offload takes before the engines wake: all kept but the parameters
        (the push reads them)."""
        return tuple(p for p in self._moving if p in KEPT_PARTS and p != "params")

    def _measure_engines(self, awake: list[dict[str, float]], asleep: list[dict[str, float]]) -> None:
        """What the engines freed on each trainer rank's device going to sleep (what they take back when they
        wake); the most seen per rank, so a step some engines missed (dead, replaced later) never lowers it."""
        if not all("free_bytes" in r for r in (*awake, *asleep)):
            return
        freed = [max(0.0, b["free_bytes"] - a["free_bytes"]) for a, b in zip(awake, asleep, strict=True)]
        seen = self._engines_bytes or [0.0] * len(freed)
        self._engines_bytes = [max(x, y) for x, y in zip(seen, freed, strict=True)]

    def _plan(self) -> tuple[str, ...]:
        """The parts that leave at this step's push: `trainer.offload.*`, less what stays on the device under
        `trainer.offload.when=needed` (`parts_leaving`); a change of plan is logged."""
        kept = tuple(p for p in self.parts if p in KEPT_PARTS)
        if not self.as_needed or not kept:
            return self.parts
        assert self.system.trainer is not None
        ranks = self.system.trainer.device_memory(parts=True)
        leaving = parts_leaving(kept, ranks, self._engines_bytes)
        plan = tuple(p for p in self.parts if p not in kept or p in leaving)
        if plan != self._moving and self._engines_bytes is not None:  # measured: every rank reads its memory
            stay = [p for p in kept if p not in leaving]
            logger.info("hand-off (trainer.offload.when=needed): %s while the engines generate (rank 0: %.1f GiB "
                        "free, the engines take %.1f GiB of %.1f GiB)",
                        f"{', '.join(stay)} stay on the device" if stay else "every kept part leaves",
                        ranks[0]["free_bytes"] / 2**30, self._engines_bytes[0] / 2**30, ranks[0]["total_bytes"] / 2**30)
        return plan

    def push(self, version: int) -> tuple[SyncReport, float]:
        """Push the trainer's weights as `version` (`System.push_weights`), handing the device to the engines
        around it (`prepare_push` first, unless done for `version`); the report and the push's wall seconds (the
        trainer's offloads are not in them, but for the wait for an overlapped one's copies, made inside the
        push; its probe scores, taken first, are: the report's first phase, `probe_trainer`)."""
        assert self.system.pusher is not None and self.system.trainer is not None
        if not self.enabled:
            return self.system.push_weights(version)
        if self._probe is None or self._probe[0] != version:
            self.prepare_push(version)  # a push from `both` (warm-up, resume) puts the engines to sleep first
        assert self._probe is not None
        probe_s, self._probe = self._probe[1], None
        waited = self._join_wake()
        rest = self._kept_before_push()
        if rest:  # the staged copies taken; the parameters stay on the device: the push reads them
            self._leaving = self._offload(rest, self.room)["deferred"] > 0.0
            self._overlapped = float(self._leaving)
        try:
            report, seconds = self.system.push_weights(version, self._finish_offload if self._leaving else None)
        finally:
            self._finish_offload()  # a push that never reached the engines' KV wake (no engine left, a failure)
            self._drop_staged_for_save()
        if probe_s:  # the push's first phase, and part of its seconds
            report.phases = {"probe_trainer": probe_s, **report.phases}
            seconds += probe_s
        if waited is not None:  # the weights resumed since `prepare_push`: the push waited only for the rest
            report.phases["wake_weights"] = report.phases.get("wake_weights", 0.0) + waited
            seconds += waited
        self._add("engine_wake", self.system.pusher.wake_seconds)
        self._offload(tuple(p for p in self._moving if p == "params"))
        self.holder = Holder.ENGINES
        return report, seconds

    def _drop_staged_for_save(self) -> None:
        """The copies staged for the step's save of what stays on the device: no offload takes them, the save holds
        what it writes, and the trainer's next write of those parts must wait for them (`drop_staged`)."""
        if self._staged_for_save:
            assert self.system.trainer is not None
            self.system.trainer.drop_staged(self._staged_for_save)
            self._staged_for_save = ()

    def _join_wake(self) -> float | None:
        """The seconds spent waiting for the weights `_wake_weights_early` resumes (None: it did not); their
        resume's own seconds join `time/engine_wake_seconds`."""
        if self._waking is None:
            return None
        waking, self._waking = self._waking, None
        start = time.perf_counter()
        self._add("engine_wake", waking.result())
        return time.perf_counter() - start

    def _finish_offload(self) -> None:
        """The offload copies left in flight landed and their memory freed, once (before the engines' KV wake)."""
        if self._leaving:
            assert self.system.trainer is not None
            self._leaving = False
            self._add("offload", self.system.trainer.finish_offload()["seconds"])

    def measure(self, phase: str) -> None:
        """Record the memory at the end of `phase` (colocated runs only)."""
        if self.colocated and self.system.trainer is not None:
            for key, value in self.system.trainer.memory_stats().items():
                self._memory[f"memory/{phase}_{key}"] = value

    def stats(self) -> dict[str, Any]:
        """This step's transition seconds (`time/<transition>_seconds`), whether its push overlapped the
        optimizer offload (`time/offload_overlapped`) and memory per phase; then reset."""
        out: dict[str, Any] = {f"time/{k}_seconds": v for k, v in self._seconds.items()}
        if self._overlapped is not None:
            out["time/offload_overlapped"] = self._overlapped
        out.update(self._memory)
        self._seconds, self._overlapped, self._memory = {}, None, {}
        return out
