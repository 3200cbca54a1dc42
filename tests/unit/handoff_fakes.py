"""Stand-ins for a hand-off's trainer role, pusher and fleet that log what the hand-off asks of them, in order."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from types import SimpleNamespace

from miles_lite.config.compose import load_config
from miles_lite.run.handoff import Handoff
from miles_lite.trainer.offload import OverlapRoom

GIB = float(1 << 30)


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

    def finish_offload(self) -> dict[str, float]:
        self.log.append("settle")
        return {"seconds": 0.5}

    def onload(self, parts: tuple[str, ...]) -> dict[str, float]:
        self.log.append("onload")
        if self.device is not None:
            self.device.resident |= set(self.device.parts)
        return {"seconds": 0.0}


class FakePusher:
    """What `FleetPusher.push` does to sleeping engines, in order."""

    def __init__(self, log: list[str], fail: bool = False, device: FakeDevice | None = None) -> None:
        self.log, self.fail, self.wake_seconds, self.device = log, fail, 0.0, device
        # The device's free GiB as the engines' KV cache woke (None: no device).
        self.free_at_wake: float | None = None

    def push(self, before_wake: Callable[[], None] | None) -> str:
        self.log += ["wake weights", "load"]
        if self.fail:
            raise RuntimeError("the engines refused the load")
        if before_wake is not None:
            before_wake()
        self.log.append("wake kv cache")
        if self.device is not None:
            self.device.awake = True
            self.free_at_wake = self.device.free()
        self.wake_seconds = 0.125
        return "report"


class FakeFleet:
    def __init__(self, log: list[str], device: FakeDevice | None = None) -> None:
        self.log, self.device = log, device

    async def sleep(self, tags: tuple[str, ...]) -> None:
        self.log.append("engines sleep")
        if self.device is not None:
            self.device.awake = False


def handoff_of(room: bool, fail: bool = False, overrides: tuple[str, ...] = (),
               device: FakeDevice | None = None) -> tuple[Handoff, list[str], FakeTrainer]:
    """A hand-off over the fakes (`device`: the memory they share), its log and its trainer; `overrides` of the
    config."""
    log: list[str] = []
    cfg = load_config(["cluster.placement=colocated", *overrides])
    trainer, pusher = FakeTrainer(log, room, device), FakePusher(log, fail, device)

    def push_weights(version: int, before_wake: Callable[[], None] | None = None) -> tuple[str, float]:
        return pusher.push(before_wake), 1.0

    def score_trainer_probe(version: str) -> float:
        log.append(f"score probe {version}")
        return 0.0

    sync = SimpleNamespace(score_trainer_probe=score_trainer_probe)
    system = SimpleNamespace(cfg=cfg, offloaded_at_start=cfg.trainer.offload.parts(), trainer=trainer, pusher=pusher,
                             fleet=FakeFleet(log, device), loop_thread=SimpleNamespace(run=asyncio.run),
                             push_weights=push_weights, sync=sync)
    return Handoff(system), log, trainer  # type: ignore[arg-type]
