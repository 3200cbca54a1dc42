"""The weight-transport seam: `connect(fleet)`, `push(named_shards, version) -> PushReport`, `close()`.

A transport lives in the process that holds every trainer shard at push time (the trainer's TP
rank 0 after its gather, or the driver); engines are reached through the `RolloutEngine` HTTP seam.
Engine calls are coroutines bound to the rollout event loop (aiohttp sessions belong to one loop),
so transports submit them to that loop (`EngineLoop`) and block on the results, which lets a
transport post HTTP requests *and* take part in the collective that those requests wait on.

Lifecycle (explicit): NEW -> CONNECTED -> (push ...) -> CLOSED; `connect` again on a changed fleet
re-creates connections; a failed push leaves the transport FAILED until `connect` is called again.
"""

from __future__ import annotations

import abc
import asyncio
import enum
import time
from collections.abc import Callable, Coroutine, Iterator, Mapping, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from miles_lite.rollout.engine import RolloutEngine
from miles_lite.weight_sync.plan import EngineSpec

T = TypeVar("T")

# Trainer shards, index = trainer TP rank, each {trainer tensor name: local tensor}; or a callable
# producing them (its run time is reported as the gather phase).
TrainerShards = Sequence[Mapping[str, torch.Tensor]]
ShardSource = TrainerShards | Callable[[], TrainerShards]

PHASES = ("gather", "convert", "transfer", "load")


class WeightSyncError(RuntimeError):
    """A push did not leave an engine serving the new weights; the message names the engine."""


class TransportState(enum.Enum):
    NEW = "new"
    CONNECTED = "connected"
    FAILED = "failed"
    CLOSED = "closed"


@dataclass(frozen=True)
class FleetEngine:
    """An engine as weight sync sees it: the HTTP client and its sharding (`spec.engine_id` names it)."""

    engine: RolloutEngine
    spec: EngineSpec

    @property
    def engine_id(self) -> str:
        return self.spec.engine_id


@dataclass
class PushReport:
    """What one push cost: seconds per phase (gather / convert / transfer / load) and bytes moved."""

    version: str
    transport: str
    engines: tuple[str, ...]
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    bytes: int = 0
    buckets: int = 0

    @property
    def total_seconds(self) -> float:
        return sum(self.seconds.values())

    @property
    def gb_per_s(self) -> float:
        """Bytes moved over transfer + load seconds, in GB/s (1e9 bytes)."""
        busy = self.seconds["transfer"] + self.seconds["load"]
        return self.bytes / busy / 1e9 if busy > 0 else 0.0

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Add the wall time of the `with` body to phase `name`."""
        if name not in self.seconds:
            raise KeyError(f"unknown push phase {name!r}; phases are {PHASES}")
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - start


class EngineLoop:
    """Runs engine coroutines on the rollout event loop from a plain thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop, timeout_s: float = 600.0) -> None:
        self.loop = loop
        self.timeout_s = timeout_s

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        """Start `coro` on the loop; the caller keeps working and collects the result later."""
        if not self.loop.is_running():
            coro.close()
            raise RuntimeError("the rollout event loop is not running; start it before syncing weights")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` to completion and return its result."""
        return self.submit(coro).result(self.timeout_s)

    def gather(self, futures: Mapping[str, Future[Any]]) -> dict[str, Any]:
        """Wait for every future; raise `WeightSyncError` naming each engine whose call failed."""
        results: dict[str, Any] = {}
        errors: dict[str, BaseException] = {}
        for engine_id, fut in futures.items():
            try:
                results[engine_id] = fut.result(self.timeout_s)
            except Exception as exc:  # every failure is reported with the engine that raised it
                errors[engine_id] = exc
        if errors:
            detail = "; ".join(f"engine {eid}: {exc!r}" for eid, exc in errors.items())
            raise WeightSyncError(f"weight update failed on {sorted(errors)}: {detail}")
        return results


def resolve_shards(named_shards: ShardSource, report: PushReport, senders: int | None = None) -> TrainerShards:
    """Materialise trainer shards, timing a callable source as the gather phase; `senders`: how many the plan
    reads (the plan's `senders`), checked."""
    if callable(named_shards):
        with report.phase("gather"):
            shards = named_shards()
    else:
        shards = named_shards
    if senders is not None and len(shards) != senders:
        raise WeightSyncError(f"{report.transport} push got {len(shards)} trainer shards for {senders} senders (the "
                              "trainer's TP ranks and the holders of routed experts)")
    return shards


class WeightTransport(abc.ABC):
    """Moves trainer weights into every engine of the fleet."""

    name = "abstract"

    def __init__(self) -> None:
        self.state = TransportState.NEW
        self.fleet: tuple[FleetEngine, ...] = ()

    @abc.abstractmethod
    def connect(self, fleet_engines: Sequence[FleetEngine]) -> None:
        """Prepare to push to exactly these engines (again, when the fleet changed)."""

    @abc.abstractmethod
    def push(self, named_shards: ShardSource, version: str) -> PushReport:
        """Load the trainer's weights into every connected engine, tagged `version`."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release connections and groups (idempotent)."""

    def _require(self, *states: TransportState) -> None:
        if self.state not in states:
            raise WeightSyncError(
                f"{self.name} transport is {self.state.value}; this call needs {[s.value for s in states]}"
                + (" (call connect(fleet) first)" if TransportState.CONNECTED in states else "")
            )

    def _set_fleet(self, fleet_engines: Sequence[FleetEngine]) -> None:
        ids = [f.engine_id for f in fleet_engines]
        if not ids:
            raise WeightSyncError(f"{self.name} transport: connect() got an empty fleet")
        if len(set(ids)) != len(ids):
            raise WeightSyncError(f"{self.name} transport: duplicate engine ids {ids}")
        self.fleet = tuple(fleet_engines)
