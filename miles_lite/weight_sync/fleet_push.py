"""A weight push to a fleet: which engines it targets, and what happens when one died since its last
health check.

The fleet's state belongs to the rollout loop (its transitions wake tasks waiting there): it is read and
changed on that loop, never from the pushing thread.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence

from miles_lite.rollout.engine import MEMORY_TAGS
from miles_lite.rollout.engine_state import EngineRecord, EngineState
from miles_lite.rollout.fleet import EngineFleet
from miles_lite.timing import PhaseTimer
from miles_lite.weight_sync.coordinator import SyncReport, WeightSyncCoordinator
from miles_lite.weight_sync.plan import EngineSpec
from miles_lite.weight_sync.transport import EngineLoop, FleetEngine, PushReport, ShardSource, WeightSyncError

# Rows an engine pads its vocabulary to: reference engines hold HF shapes, SGLang pads to 64.
VOCAB_PAD = {"reference": 1, "sglang": 64}


class FleetPusher:
    """Pushes versions of the trainer's weights to every engine of `fleet` that serves or waits to."""

    def __init__(self, sync: WeightSyncCoordinator, fleet: EngineFleet, loop: EngineLoop, engine_tp: int,
                 backend: str) -> None:
        self.sync = sync
        self.fleet = fleet
        self.loop = loop
        self.engine_tp = engine_tp
        self.vocab_pad = VOCAB_PAD[backend]
        # Seconds the last push spent waking sleeping engines (weights before it, the rest after the load).
        self.wake_seconds = 0.0

    def push(self, shards: ShardSource, version: str, *, stale_only: bool = False,
             before_wake: Callable[[], None] | None = None) -> SyncReport:
        """Push `shards` as `version` to the healthy and stale engines (`stale_only`: to the stale ones,
        bringing replacements to the version the healthy ones serve; `version` must be the current one).

        An engine that died since its last health check fails the push: the engines of the push are
        then health-checked at once, the dead ones go to the fleet for replacement, and the push is
        made again to the others (once); with none left, the report names no engine. A failure on live
        engines (a dropped update, a probe mismatch) is raised. A healthy engine whose address answers from a
        new process (its pod was recreated before a health check noticed) is left out before the push starts.

        Sleeping engines (colocated roles) are pushed to in order: their weights are resumed first, the
        push loads them, and their KV cache (and CUDA graphs) are resumed before they continue and are
        verified (`wake_seconds`). `before_wake` runs once the engines hold the new version, just before that
        resume (the colocated trainer frees memory there for it; `run/handoff.py`); it may run again if the
        push is made again, and not at all if the push reaches no engine or fails before the load.
        """
        fleet = self.fleet
        self.wake_seconds = 0.0
        targets = ((EngineState.STALE,) if stale_only
                   else (EngineState.HEALTHY, EngineState.STALE, EngineState.SLEEPING))

        async def wake(tags: Sequence[str]) -> None:
            start = time.perf_counter()
            await fleet.wake(tags, [r for r in fleet.records if r.state is EngineState.SLEEPING])
            self.wake_seconds += time.perf_counter() - start

        def wake_rest() -> None:
            if before_wake is not None:
                before_wake()
            self.loop.run(wake([t for t in MEMORY_TAGS if t != "weights"]))

        timer = PhaseTimer()
        if not stale_only and fleet.sleeping():
            # A sleeping engine that cannot resume is declared dead there and is not a target below.
            with timer.phase("wake_weights"):
                self.loop.run(wake(["weights"]))

        async def begin() -> list[EngineRecord]:
            if stale_only and version != fleet.current_version:
                raise ValueError(f"a push to stale engines carries the current version {fleet.current_version!r}, "
                                 f"not {version!r}")
            records = [r for r in fleet.records if r.state in targets]
            if not stale_only:
                gone = await fleet.drop_restarted([r for r in records if r.state is EngineState.HEALTHY])
                records = [r for r in records if all(r is not g for g in gone)]
            fleet.set_current_version(version)
            fleet.begin_weight_update(records)
            return records

        async def finish(synced: Sequence[EngineRecord]) -> None:
            fleet.end_weight_update(held, answered=bool(synced))
            for r in synced:
                fleet.mark_synced(r.engine_id, version)

        with timer.phase("begin"):
            held = records = self.loop.run(begin())
        if stale_only and not records:
            self.loop.run(finish([]))
            raise WeightSyncError("no stale engine left to push to (it died or was synced meanwhile)")
        if not records:
            return self._pushed_to_none(version, finish)
        try:
            try:
                report = self.sync.push(self.targets(records), shards, version, after_load=wake_rest)
            except WeightSyncError:
                dead = self.loop.run(fleet.confirm_dead(records))
                records = [r for r in records if all(r is not d for d in dead)]
                if not dead or (stale_only and not records):
                    raise
                if not records:
                    return self._pushed_to_none(version, finish)
                report = self.sync.push(self.targets(records), shards, version, after_load=wake_rest)
        except BaseException:
            self.loop.run(finish([]))
            raise
        self.loop.run(finish(records))
        report.phases = {**timer.seconds, **report.phases}
        return report

    def _pushed_to_none(self, version: str, finish: Callable[[Sequence[EngineRecord]], Awaitable[None]]
                        ) -> SyncReport:
        # Every engine died: the version stays current and the replacements come up stale; a rollout
        # starved of engines gets it pushed (`on_starved`) while the trainer holds it.
        self.loop.run(finish([]))
        return SyncReport(PushReport(version, self.sync.transport.name, ()), None, 0.0)

    def targets(self, records: Sequence[EngineRecord]) -> list[FleetEngine]:
        """The weight-sync view of fleet `records`: each engine with its id, TP size and vocabulary padding."""
        # A replacement keeps its slot's engine id but is a new process: naming the incarnation makes
        # the weight-sync coordinator see a new fleet and rebuild its group with the replacement in it.
        sync_ids = [r.engine_id if r.incarnation == 0 else f"{r.engine_id}.{r.incarnation}" for r in records]
        return [FleetEngine(r.engine, EngineSpec(sid, self.engine_tp, self.vocab_pad))
                for r, sid in zip(records, sync_ids, strict=True)]
