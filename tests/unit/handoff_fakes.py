"""Stand-ins for a hand-off's trainer role, pusher and fleet that log what the hand-off asks of them, in order."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any, TypeVar

from miles_lite.config.compose import load_config
from miles_lite.run.handoff import Handoff
from miles_lite.trainer.offload import OverlapRoom

GIB = float(1 << 30)
T = TypeVar("T")


class FakeDevice:
    """One device's memory, in GiB: the engines' pools (released asleep), the trainer's parts resident (grads
    aside) and what neither releases (CUDA contexts, the engines' other memory)."""

    def __init__(self, total: float, engines: float, parts: dict[str, float], fixed: float = 2.0) -> None:
        self.total, self.engines, self.parts, self.fixed = total, engines, parts, fixed
        # A run starts with the trainer's parts offloaded and the engines generating.
        self.awake = True
        self.resident: set[str] = set()

    def free(self) -> float:
        used = self.fixed + sum(self.parts[p] for p in self.resident) + (self.engines if self.awake else 0.0)
        return self.total - used

    def memory(self, parts: bool) -> dict[str, float]:
        out = {"free_bytes": self.free() * GIB, "total_bytes": self.total * GIB}
        held = {f"{p}_bytes": (self.parts[p] if p in self.resident else 0.0) * GIB for p in self.parts}
        return {**out, **held} if parts else out


class FakeTrainer:
    def __init__(self, log: list[str], room: bool, device: FakeDevice | None = None) -> None:
        self.log, self.room, self.rooms, self.device = log, room, [], device

    def device_memory(self, parts: bool = False) -> list[dict[str, float]]:
        return [self.device.memory(parts) if self.device is not None else {}]

    def _left(self, parts: tuple[str, ...]) -> None:
        if self.device is not None:
            self.device.resident -= set(parts)

    def offload(self, parts: tuple[str, ...], room: OverlapRoom | None = None) -> dict[str, float]:
        self.rooms.append(room)
        self._left(parts)
        deferred = room is not None and self.room and "optimizer" in parts
        self.log.append(f"offload {','.join(parts)}{' (in flight)' if deferred else ''}")
        out = {"seconds": 0.25}
        return out if room is None else {**out, "deferred": float(deferred)}

    def stage_offload(self, parts: tuple[str, ...]) -> dict[str, float]:
        self.log.append(f"stage {','.join(parts)}")
        return {"seconds": 0.0625}

    def drop_staged(self, parts: tuple[str, ...]) -> None:
        self.log.append(f"unstage {','.join(parts)}")

    def finish_offload(self) -> dict[str, float]:
        self.log.append("settle")
        return {"seconds": 0.5}

    def onload(self, parts: tuple[str, ...]) -> dict[str, float]:
        self.log.append("onload")
        if self.device is not None:
            self.device.resident |= set(self.device.parts)
        return {"seconds": 0.0}


class FakePusher:
    """What `FleetPusher.push` does to sleeping engines, in order (their weights resumed first, unless they are)."""

    def __init__(self, log: list[str], fleet: FakeFleet, fail: bool = False, device: FakeDevice | None = None) -> None:
        self.log, self.fleet, self.fail, self.wake_seconds, self.device = log, fleet, fail, 0.0, device
        # The device's free GiB as the engines' KV cache woke (None: no device).
        self.free_at_wake: float | None = None

    def push(self, before_wake: Callable[[], None] | None) -> SimpleNamespace:
        if "weights" in self.fleet.released:
            self.fleet.released.discard("weights")
            self.log.append("wake weights")
        self.log.append("load")
        if self.fail:
            raise RuntimeError("the engines refused the load")
        if before_wake is not None:
            before_wake()
        self.log.append("wake kv cache")
        self.fleet.released.clear()
        if self.device is not None:
            self.device.awake = True
            self.free_at_wake = self.device.free()
        self.wake_seconds = 0.125
        return SimpleNamespace(phases={"load": 0.5})


class FakeFleet:
    def __init__(self, log: list[str], device: FakeDevice | None = None) -> None:
        self.log, self.device = log, device
        self.released: set[str] = set()

    async def sleep(self, tags: tuple[str, ...]) -> None:
        self.log.append("engines sleep")
        self.released = set(tags)
        if self.device is not None:
            self.device.awake = False

    async def wake(self, tags: list[str]) -> None:
        """The hand-off's early resume of the engines' weights (what the pusher does otherwise)."""
        assert tags == ["weights"] and "weights" in self.released
        self.released.discard("weights")
        self.log.append("wake weights (early)")


class FakeLoopThread:
    """The rollout loop's thread: `run` waits; `submit` runs at once (the log keeps the order asked)."""

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run(coro)

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        done: Future[T] = Future()
        done.set_result(asyncio.run(coro))
        return done


def handoff_of(room: bool, fail: bool = False, overrides: tuple[str, ...] = (),
               device: FakeDevice | None = None) -> tuple[Handoff, list[str], FakeTrainer]:
    """A hand-off over the fakes (`device`: the memory they share), its log and its trainer; `overrides` of the
    config."""
    log: list[str] = []
    cfg = load_config(["cluster.placement=colocated", *overrides])
    fleet = FakeFleet(log, device)
    trainer, pusher = FakeTrainer(log, room, device), FakePusher(log, fleet, fail, device)

    def push_weights(version: int, before_wake: Callable[[], None] | None = None) -> tuple[SimpleNamespace, float]:
        return pusher.push(before_wake), 1.0

    def score_trainer_probe(version: str) -> float:
        log.append(f"score probe {version}")
        return 0.0

    sync = SimpleNamespace(score_trainer_probe=score_trainer_probe)
    system = SimpleNamespace(cfg=cfg, offloaded_at_start=cfg.trainer.offload.parts(), trainer=trainer, pusher=pusher,
                             fleet=fleet, loop_thread=FakeLoopThread(),
                             push_weights=push_weights, sync=sync)
    return Handoff(system), log, trainer  # type: ignore[arg-type]
