"""One weight push, start to end: pause -> flush -> push -> version check -> continue -> verify.

Each push reports the seconds of its phases (`SyncReport.phases`, the run's `sync/phase_<name>_seconds`):
`probe_before` (the engines' probe scores under their old weights, when pushes are verified), `pause` (pause
and flush), `load` (the transport's push), `check` (every engine's version), `after_load` (the caller's hook:
the hand-off's wait for its offload and the engines' KV-cache resume), `resume` and `verify` (the probe on the
new weights: the engines' scores, and the trainer's unless it took them ahead, as a hand-off does before its
offload's copies are queued: `score_trainer_probe`, the push's `probe_trainer` phase in `run/handoff.py`).

Connecting to a new fleet (the first push of a trainer, or after an engine was replaced) also continues
every engine: a trainer that died mid-push leaves its engines paused, and its replacement takes them over.

A `threading.Lock` serialises pushes (two pushes never interleave, whichever threads call).
States: IDLE -> PAUSING -> PUSHING -> CHECKING (versions) -> RESUMING -> CHECKING (probe, on running
engines) -> IDLE; any failure ends in FAILED
(engines are resumed even then, so they keep serving; the caller marks them stale and the next
push, after `connect` on the new fleet, brings them current).
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from miles_lite.timing import PhaseTimer
from miles_lite.weight_sync.transport import (
    EngineLoop,
    FleetEngine,
    PushReport,
    ShardSource,
    TransportState,
    WeightSyncError,
    WeightTransport,
)
from miles_lite.weight_sync.verify import PushVerifier, VerifyReport


class SyncState(enum.Enum):
    IDLE = "idle"
    PAUSING = "pausing"
    PUSHING = "pushing"
    CHECKING = "checking"
    RESUMING = "resuming"
    FAILED = "failed"


# The phases during which the engines are paused (`SyncReport.paused_s`).
PAUSED_PHASES = ("pause", "load", "check", "after_load", "resume")


@dataclass
class SyncReport:
    """A push's transport report, verification (None when disabled), the pause window and each phase in seconds."""

    push: PushReport
    verify: VerifyReport | None
    paused_s: float
    phases: dict[str, float] = field(default_factory=dict)


class WeightSyncCoordinator:
    """Runs pushes through one transport, reconnecting it whenever the fleet changes."""

    def __init__(self, transport: WeightTransport, loop: EngineLoop, verifier: PushVerifier | None = None) -> None:
        self.transport = transport
        self.loop = loop
        self.verifier = verifier
        self.state = SyncState.IDLE
        self._lock = threading.Lock()
        self._fleet_ids: tuple[str, ...] = ()

    def _each(self, fleet: Sequence[FleetEngine], method: str) -> dict[str, object]:
        return self.loop.gather({f.engine_id: self.loop.submit(getattr(f.engine, method)()) for f in fleet})

    def push(self, fleet: Sequence[FleetEngine], named_shards: ShardSource, version: str,
             after_load: Callable[[], None] | None = None) -> SyncReport:
        """Push `named_shards` as `version` to every engine of `fleet`; raises `WeightSyncError` naming engines.

        `after_load`: called once the engines hold the new version, before they continue and are verified
        (sleeping engines resume their KV cache there: they were woken with their weights only).
        """
        version = str(version)
        with self._lock:
            ids = tuple(f.engine_id for f in fleet)
            if ids != self._fleet_ids or self.transport.state is not TransportState.CONNECTED:
                self.transport.connect(fleet)
                self._fleet_ids = ids
                # Only a push pauses engines, and every push here resumes them, even when it fails: an engine
                # found paused now was left so by another process, a trainer that died mid-push (SIGKILL, a lost
                # node). Paused, it would hold every request, this push's own probe first.
                self._each(fleet, "resume")
            self.state = SyncState.PAUSING
            timer = PhaseTimer()
            if self.verifier is not None:
                with timer.phase("probe_before"):
                    self.verifier.before_push(fleet, version)
            try:
                with timer.phase("pause"):
                    self._each(fleet, "pause")
                    self._each(fleet, "flush_cache")
                self.state = SyncState.PUSHING
                with timer.phase("load"):
                    push = self.transport.push(named_shards, version)
                self.state = SyncState.CHECKING
                with timer.phase("check"):
                    versions = self.loop.gather(
                        {f.engine_id: self.loop.submit(f.engine.weight_version()) for f in fleet})
                    wrong = {eid: v for eid, v in versions.items() if str(v) != version}
                    if wrong:
                        raise WeightSyncError(f"after pushing version {version}, engines report {wrong}")
                if after_load is not None:
                    with timer.phase("after_load"):
                        after_load()
            except BaseException:
                self.state = SyncState.FAILED
                self._resume_quietly(fleet)
                raise
            self.state = SyncState.RESUMING
            with timer.phase("resume"):
                self._each(fleet, "resume")
            paused_s = sum(timer.seconds.get(p, 0.0) for p in PAUSED_PHASES)
            verify = None
            if self.verifier is not None:
                # Scoring needs running engines; a failure here names the engines to mark stale.
                self.state = SyncState.CHECKING
                try:
                    with timer.phase("verify"):
                        verify = self.verifier.verify(fleet, version)
                except BaseException:
                    self.state = SyncState.FAILED
                    raise
            self.state = SyncState.IDLE
            return SyncReport(push, verify, paused_s, timer.seconds)

    def score_trainer_probe(self, version: str) -> float:
        """With verification on, the trainer scores the probe for `version` now (`PushVerifier.score_trainer`);
        the seconds it took (0 without verification)."""
        if self.verifier is None:
            return 0.0
        start = time.perf_counter()
        self.verifier.score_trainer(version)
        return time.perf_counter() - start

    def _resume_quietly(self, fleet: Sequence[FleetEngine]) -> None:
        # Engines keep serving after a failed push; the push's own error is what the caller sees.
        for f in fleet:
            self.loop.submit(f.engine.resume()).exception(self.loop.timeout_s)

    def close(self) -> None:
        """Close the transport (after the current push, if any)."""
        with self._lock:
            self.transport.close()
