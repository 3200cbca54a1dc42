"""Engine slot records and their lifecycle table (the state machine `EngineFleet` drives).

    starting -> healthy -> dead -> replacing -> stale -> healthy
        \\-> dead            replacing -> dead     stale -> dead
        \\-> stale (an engine added to a running fleet, before it holds the current weights)
               healthy <-> sleeping -> dead
    any state -> retired (the engine was removed from the fleet; final)

A sleeping engine has released memory (`EngineRecord.released`: weights, KV cache, CUDA graphs) while
the trainer uses the device; it serves nothing and is not health-checked until it is woken.
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from miles_lite.rollout.engine import RolloutEngine


class EngineState(enum.Enum):
    """Lifecycle state of one engine slot."""

    STARTING = "starting"
    HEALTHY = "healthy"
    DEAD = "dead"
    REPLACING = "replacing"
    STALE = "stale"
    SLEEPING = "sleeping"
    RETIRED = "retired"


TRANSITIONS: dict[EngineState, frozenset[EngineState]] = {
    EngineState.STARTING: frozenset({EngineState.HEALTHY, EngineState.STALE, EngineState.DEAD, EngineState.RETIRED}),
    EngineState.HEALTHY: frozenset({EngineState.DEAD, EngineState.SLEEPING, EngineState.RETIRED}),
    EngineState.SLEEPING: frozenset({EngineState.HEALTHY, EngineState.DEAD, EngineState.RETIRED}),
    EngineState.DEAD: frozenset({EngineState.REPLACING, EngineState.RETIRED}),
    EngineState.REPLACING: frozenset({EngineState.STALE, EngineState.DEAD, EngineState.RETIRED}),
    EngineState.STALE: frozenset({EngineState.HEALTHY, EngineState.DEAD, EngineState.RETIRED}),
    EngineState.RETIRED: frozenset(),
}


class IllegalTransition(RuntimeError):
    """A state change that the engine lifecycle does not allow."""


@dataclass
class EngineHandle:
    """What a launcher returns: a ready engine client and how to stop its server.

    `stop` may be sync or async; it must end the server process (the fleet calls it on a dead
    engine before starting its replacement, so a hung process never lingers).
    """

    engine: RolloutEngine
    stop: Callable[[], object] | None = None
    pid: int | None = None
    # Where the server runs (a `cluster.engine_actor.EngineLocation` on Ray; None for a local child).
    location: object | None = None
    # diagnose(why): records what the server's processes are doing (their stacks), asked by the fleet before it
    # stops an engine it declared dead (a hung one still runs); returns where (None: nothing recorded).
    diagnose: Callable[[str], Awaitable[Path | None]] | None = None

    @property
    def local_child(self) -> bool:
        """Whether the server is a child process this one started (no other party can start one at its address)."""
        return self.pid is not None and self.location is None


# launcher(slot_index, incarnation) -> a started engine that answers /health_generate.
Launcher = Callable[[int, int], Awaitable[EngineHandle]]


@dataclass(frozen=True)
class Transition:
    """One recorded state change (for tests, logs and the event timeline)."""

    time_s: float
    slot: int
    engine_id: str
    old: EngineState
    new: EngineState
    reason: str


# Reason of a replacement admitted without a push: it started with the weights the fleet serves.
ALREADY_CURRENT = "it already serves the current weight version"


def console_line(t: Transition, current_version: str | None) -> str | None:
    """What a user reading the console should see of a transition (None: routine, e.g. a first start)."""
    where = f"engine slot {t.slot} ({t.engine_id})"
    if t.new is EngineState.DEAD:
        return f"fleet: {where} is dead: {t.reason}"
    if t.new is EngineState.REPLACING:
        return f"fleet: {where}: starting a replacement ({t.reason})"
    if t.new is EngineState.RETIRED:
        return f"fleet: {where} removed: {t.reason}"
    if t.new is EngineState.STALE and t.old is EngineState.STARTING:
        return f"fleet: {where} added; it serves after a push of the current weights"
    if t.new is EngineState.STALE:
        return f"fleet: {where}: replacement up; it serves after a push of the current weights"
    if t.old is EngineState.STALE and t.new is EngineState.HEALTHY:
        if t.reason.startswith(ALREADY_CURRENT):
            return f"fleet: {where}: replacement admitted at once: {t.reason}"
        return f"fleet: {where}: replacement admitted after push {current_version}"
    return None


@dataclass(frozen=True)
class EngineLease:
    """One reserved request slot on one incarnation of an engine (from `EngineFleet.acquire`)."""

    record: EngineRecord
    incarnation: int

    @property
    def engine(self) -> RolloutEngine:
        return self.record.engine

    @property
    def engine_id(self) -> str:
        return self.record.engine_id


@dataclass
class EngineRecord:
    """One engine slot: the current engine in it and its bookkeeping."""

    index: int
    handle: EngineHandle
    state: EngineState = EngineState.STARTING
    # Version of the weights the engine serves ("" = unknown until reported or pushed).
    version: str = ""
    incarnation: int = 0
    inflight: int = 0
    health_failures: int = 0
    # A weight push holds the engine (paused, loading): its health answers wait for the push, so
    # health checks skip it until the push ends.
    in_weight_update: bool = False
    request_failures: int = 0
    requests_served: int = 0
    # `requests_served` when the last health round began: an engine that served since is alive unprobed.
    served_at_check: int = 0
    # Requests the engine runs at once (from its server info); None = unknown.
    capacity: int | None = None
    # Memory tags the engine has released (sleeping while any is); see `rollout.engine.MEMORY_TAGS`.
    released: frozenset[str] = frozenset()
    last_error: str = ""
    extra: dict[str, object] = field(default_factory=dict)

    @property
    def engine(self) -> RolloutEngine:
        return self.handle.engine

    @property
    def engine_id(self) -> str:
        return self.handle.engine.engine_id


def engine_capacity(server_info: dict) -> int | None:
    """Requests an engine runs at full speed at once, from its `/get_server_info`.

    SGLang reports each data-parallel scheduler's `effective_max_running_requests_per_dp` (sized from its
    KV-cache memory) in `internal_states`; otherwise the `max_running_requests` server argument counts
    when set. With CUDA graphs on, decode batches above the largest captured batch (per scheduler; SGLang picks
    256 on an H200 at TP < 4 unless told otherwise) run eagerly: measured on one H200, 512 requests in flight
    generated at 20k tokens/s where 256 ran at 45-55k, so the capacity is capped there. SGLang up to 0.5.10
    reports that size as `cuda_graph_max_bs` (off: `disable_cuda_graph`); later releases as the decode phase of
    their resolved `cuda_graph_config` (`max_bs`, off: `backend` "disabled").
    """
    states = server_info.get("internal_states") or []
    per_dp = [s.get("effective_max_running_requests_per_dp") for s in states if isinstance(s, dict)]
    if per_dp and all(isinstance(n, int) and n > 0 for n in per_dp):
        running = [int(n) for n in per_dp]
    else:
        top = server_info.get("max_running_requests")
        if not (isinstance(top, int) and top > 0):
            return None
        running = [top]
    graph_bs = decode_graph_batch(server_info)
    if graph_bs is not None:
        running = [min(n, graph_bs) for n in running]
    return sum(running)


def decode_graph_batch(server_info: dict) -> int | None:
    """The largest decode batch an SGLang engine runs in a CUDA graph (per scheduler); None when its decode runs
    without graphs or the engine does not say (the reference engine)."""
    decode = (server_info.get("cuda_graph_config") or {}).get("decode")
    if isinstance(decode, dict):  # SGLang after 0.5.10: the resolved per-phase config
        graph_bs = decode.get("max_bs")
        on = decode.get("backend") not in (None, "disabled") and not server_info.get("disable_cuda_graph")
    else:
        graph_bs = server_info.get("cuda_graph_max_bs")
        on = server_info.get("disable_cuda_graph") is False
    return graph_bs if on and isinstance(graph_bs, int) and graph_bs > 0 else None
