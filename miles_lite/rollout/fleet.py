"""EngineFleet: the rollout engines of a job, their lifecycle, health checks and replacement.

Every engine slot walks one state machine (illegal moves raise `IllegalTransition`)::

    starting -> healthy -> dead -> replacing -> stale -> healthy
        \\-> dead            replacing -> dead     stale -> dead
    any state -> retired (scaled away: `retire`; `admit` adds an engine to a running fleet)

Only `healthy` engines receive requests. An engine is declared dead after
`fault_tolerance.failure_threshold` consecutive failed health checks or failed requests; a
replacement is then started through the launcher callable (up to `max_engine_restarts` per job) and
comes up `stale`: it serves nothing until a weight push brings it to the fleet's current version
(`mark_synced`); one that reports the current version already (no push since the fleet started) is
admitted at once. When a request waits with no healthy engine while a stale one is up, the fleet calls
`on_starved`: nothing else would push to the replacement before the waiting rollout ends. The fleet
also does the request accounting that the rollout manager schedules by:
outstanding requests per engine, and the choice of the least-loaded healthy engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
from collections.abc import Awaitable, Callable, Sequence

from miles_lite.config.schema import FaultToleranceConfig
from miles_lite.rollout.engine import RolloutEngine
from miles_lite.rollout.engine_health import (
    LIVE,
    probe,
    probe_live,
    reported_capacity,
    reported_version,
    restarted_among,
)
from miles_lite.rollout.engine_state import (
    TRANSITIONS,
    EngineHandle,
    EngineLease,
    EngineRecord,
    EngineState,
    IllegalTransition,
    Launcher,
    Transition,
    console_line,
)
from miles_lite.rollout.fleet_membership import FleetMembership
from miles_lite.rollout.fleet_memory import FleetMemory

logger = logging.getLogger(__name__)

__all__ = ["TRANSITIONS", "EngineFleet", "EngineHandle", "EngineLease", "EngineRecord", "EngineState", "FleetAsleep",
           "FleetExhausted", "IllegalTransition", "Launcher", "Transition"]


class FleetExhausted(RuntimeError):
    """No engine is healthy and none can become healthy in time."""


class FleetAsleep(FleetExhausted):
    """A request while every engine sleeps (memory released for the trainer): only a wake lets it run."""


class EngineFleet(FleetMemory, FleetMembership):
    """The engines serving rollouts, with health checks and automatic replacement.

    Use from one asyncio event loop: `add_engine`/`launch`, `start_health_checks()`, then the
    manager calls `acquire`/`release` around each request; the weight-sync layer pushes to
    `engines_needing_weights()` and calls `mark_synced`. `close()` stops the health task and every
    engine server the fleet owns.
    """

    def __init__(
        self,
        cfg: FaultToleranceConfig,
        launcher: Launcher | None = None,
        *,
        current_version: str | None = None,
        auto_replace: bool = True,
        max_inflight_per_engine: int | None = None,
    ) -> None:
        """`launcher` starts engine slot i (needed for `launch` and for replacements).

        `current_version`: the weights every serving engine must have; None adopts the version the
        first admitted engine reports (engines start from the same checkpoint).
        `auto_replace`: start a replacement as soon as an engine dies (else call `replace_dead()`).
        `max_inflight_per_engine`: `acquire` waits while every healthy engine has this many
        outstanding requests; None = each engine's own capacity (`engine_capacity`: the requests its
        scheduler runs at once, read when it is admitted), unbounded for an engine that reports none.
        """
        if cfg.failure_threshold < 1:
            raise ValueError(f"fault_tolerance.failure_threshold must be >= 1, got {cfg.failure_threshold}")
        if cfg.health_interval_s <= 0 or cfg.health_timeout_s <= 0:
            raise ValueError("fault_tolerance.health_interval_s and health_timeout_s must be > 0")
        if max_inflight_per_engine is not None and max_inflight_per_engine < 1:
            raise ValueError(f"max_inflight_per_engine must be >= 1 or None, got {max_inflight_per_engine}")
        self.cfg = cfg
        self.launcher = launcher
        self.current_version = current_version
        self.auto_replace = auto_replace
        self.max_inflight_per_engine = max_inflight_per_engine
        self.records: list[EngineRecord] = []
        self.transitions: list[Transition] = []
        self.restarts = 0
        self.retried_requests = 0
        self.failed_requests = 0
        self.failed_health_checks = 0
        self._changed: asyncio.Condition | None = None
        self._health_task: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[None]] = set()
        self._closed = False
        # Called (on the fleet's loop) with the console line of each notable transition.
        self.on_event: Callable[[str], None] | None = None
        # Called (on the loop, by `acquire`) while a request waits and `starved()`: push to the stale engines.
        self.on_starved: Callable[[], None] | None = None

    # ----------------------------------------------------------------- lifecycle

    def _cond(self) -> asyncio.Condition:
        # Created lazily so the fleet can be built outside the loop that will run it.
        if self._changed is None:
            self._changed = asyncio.Condition()
        return self._changed

    async def _notify(self) -> None:
        async with self._cond():
            self._cond().notify_all()

    def _set_state(self, rec: EngineRecord, new: EngineState, reason: str) -> None:
        if new not in TRANSITIONS[rec.state]:
            raise IllegalTransition(
                f"engine slot {rec.index} ({rec.engine_id}): {rec.state.value} -> {new.value} is not allowed; "
                f"from {rec.state.value} it may go to {sorted(s.value for s in TRANSITIONS[rec.state])}"
            )
        self.transitions.append(Transition(time.monotonic(), rec.index, rec.engine_id, rec.state, new, reason))
        logger.info("engine %s (slot %d): %s -> %s (%s)", rec.engine_id, rec.index, rec.state.value,
                    new.value, reason)
        rec.state = new
        line = console_line(self.transitions[-1], self.current_version)
        if line is not None and self.on_event is not None:
            self.on_event(line)
        self._spawn(self._notify())

    def _spawn(self, coro: Awaitable[None]) -> None:
        try:
            task = asyncio.ensure_future(coro)
        except RuntimeError:  # no running loop: nobody can be waiting on the condition
            if inspect.iscoroutine(coro):
                coro.close()
            return
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def add_engine(self, handle: EngineHandle, *, version: str | None = None) -> EngineRecord:
        """Adopt an already started engine as a new slot; healthy once it passes a health check.

        `version`: the weights it serves (default: ask the engine). A failed first check marks it dead.
        """
        rec = EngineRecord(index=len(self.records), handle=handle)
        self.records.append(rec)
        await self._admit_new(rec, version)
        return rec

    async def launch(self, n: int) -> list[EngineRecord]:
        """Start `n` new slots through the launcher, concurrently; returns their records."""
        if self.launcher is None:
            raise ValueError("EngineFleet.launch needs a launcher; pass launcher= to EngineFleet")
        if n < 1:
            raise ValueError(f"number of engines must be >= 1, got {n}")
        first = len(self.records)
        results = await asyncio.gather(*(self.launcher(first + i, 0) for i in range(n)), return_exceptions=True)
        # Adopt every server that did start, so that close() stops it even when another one failed.
        records = [await self.add_engine(h) for h in results if isinstance(h, EngineHandle)]
        errors = [e for e in results if isinstance(e, BaseException)]
        if errors:
            raise errors[0]
        return records

    async def _admit_new(self, rec: EngineRecord, version: str | None) -> None:
        ok = await probe(rec, self.cfg.health_timeout_s)
        if not ok:
            self._set_state(rec, EngineState.DEAD, f"first health check failed: {rec.last_error}")
            self._after_death(rec)
            return
        rec.version = version if version is not None else await reported_version(rec, self.cfg.health_timeout_s)
        if self.max_inflight_per_engine is None:
            rec.capacity = await reported_capacity(rec, self.cfg.health_timeout_s)
        if self.current_version is None:
            self.current_version = rec.version
        self._set_state(rec, EngineState.HEALTHY, f"serving weight version {rec.version!r}")

    async def close(self) -> None:
        """Stop health checks and background replacements, then every engine server and client."""
        self._closed = True
        await self.stop_health_checks()
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        # Servers stop independently (each waits out its own grace period): all at once.
        await asyncio.gather(*(self._stop_engine(rec) for rec in self.records))

    async def _stop_engine(self, rec: EngineRecord) -> None:
        with contextlib.suppress(Exception):
            await rec.engine.close()
        stop = rec.handle.stop
        if stop is None:
            return
        rec.handle.stop = None  # stop each server once
        result = stop()
        if inspect.isawaitable(result):
            await result

    # ------------------------------------------------------------------ queries

    def by_id(self, engine: str | RolloutEngine | EngineRecord) -> EngineRecord:
        """The record of an engine given as record, client object or engine id."""
        if isinstance(engine, EngineRecord):
            return engine
        engine_id = engine if isinstance(engine, str) else engine.engine_id
        for rec in self.records:
            if rec.engine_id == engine_id:
                return rec
        raise KeyError(f"no engine {engine_id!r} in the fleet; engines: {[r.engine_id for r in self.records]}")

    def healthy_engines(self) -> list[RolloutEngine]:
        """Engines that may receive requests now."""
        return [r.engine for r in self.records if r.state is EngineState.HEALTHY]

    def engines_needing_weights(self) -> list[RolloutEngine]:
        """Stale replacements, plus healthy engines that serve a version other than the current one."""
        return [
            r.engine for r in self.records
            if r.state is EngineState.STALE
            or (r.state is EngineState.HEALTHY and r.version != self.current_version)
        ]

    def starved(self) -> bool:
        """No engine is healthy while a stale one is up: only a push of the current weights lets a request run."""
        states = {r.state for r in self.records}
        return EngineState.HEALTHY not in states and EngineState.STALE in states

    def state_of(self, engine: str | RolloutEngine | EngineRecord) -> EngineState:
        return self.by_id(engine).state

    def can_recover(self) -> bool:
        """Whether an engine is healthy or may become so (starting/replacing/stale, dead with restarts left)."""
        pending = {EngineState.HEALTHY, EngineState.STARTING, EngineState.REPLACING, EngineState.STALE,
                   EngineState.SLEEPING}
        if any(r.state in pending for r in self.records):
            return True
        dead = any(r.state is EngineState.DEAD for r in self.records)
        return dead and self.launcher is not None and self.restarts < self.cfg.max_engine_restarts

    def stats(self) -> dict[str, float]:
        """Counters for metrics: engines per state, restarts, retried/failed requests, failed checks."""
        out: dict[str, float] = {f"engines_{s.value}": 0.0 for s in EngineState}
        for rec in self.records:
            out[f"engines_{rec.state.value}"] += 1
        out.update(
            engines_total=float(sum(r.state is not EngineState.RETIRED for r in self.records)),
            restarts=float(self.restarts),
            retried_requests=float(self.retried_requests),
            failed_requests=float(self.failed_requests),
            failed_health_checks=float(self.failed_health_checks),
            inflight_requests=float(sum(r.inflight for r in self.records)),
        )
        return out

    async def wait_for(self, predicate: Callable[[], bool], timeout_s: float) -> bool:
        """Wait until `predicate()` holds (checked on every fleet change); False on timeout."""
        cond = self._cond()
        try:
            async with cond:
                await asyncio.wait_for(cond.wait_for(predicate), timeout_s)
            return True
        except TimeoutError:
            return predicate()

    # --------------------------------------------------------- request accounting

    async def acquire(self, exclude: frozenset[str] = frozenset(), timeout_s: float = 60.0,
                      prefer: str | None = None) -> EngineLease:
        """Reserve the healthy engine with the fewest outstanding requests.

        Engines in `exclude` (ids) are used only when no other engine is healthy. `prefer` (an engine id: the one
        holding a session's prefix cache) is taken whenever it is healthy and not excluded, waiting for its
        capacity if it is busy; otherwise the choice is as without it. Waits
        for capacity or for an engine to become healthy; raises `FleetExhausted` after `timeout_s`
        or as soon as no engine can recover.
        """
        cond = self._cond()
        deadline = time.monotonic() + timeout_s
        async with cond:
            while True:
                rec = self._pick(exclude, prefer)
                if rec is not None:
                    rec.inflight += 1
                    return EngineLease(rec, rec.incarnation)
                if self.asleep():
                    raise FleetAsleep(f"every rollout engine is asleep (memory released: "
                                      f"{[(r.engine_id, sorted(r.released)) for r in self.sleeping()]}); wake the "
                                      "fleet (EngineFleet.wake) before generating")
                if not self.can_recover():
                    raise FleetExhausted(
                        f"no healthy rollout engine and none can recover "
                        f"(restarts used {self.restarts}/{self.cfg.max_engine_restarts}); states: "
                        f"{[(r.engine_id, r.state.value) for r in self.records]}"
                    )
                if self.on_starved is not None and self.starved():
                    self.on_starved()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise FleetExhausted(
                        f"no rollout engine became available within {timeout_s:.1f}s; states: "
                        f"{[(r.engine_id, r.state.value, r.inflight) for r in self.records]}"
                    )
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(cond.wait(), left)

    def _pick(self, exclude: frozenset[str], prefer: str | None = None) -> EngineRecord | None:
        healthy = [r for r in self.records if r.state is EngineState.HEALTHY]
        sticky = next((r for r in healthy if r.engine_id == prefer and r.engine_id not in exclude), None)
        if sticky is not None:
            cap = self.max_inflight_per_engine or sticky.capacity
            return sticky if cap is None or sticky.inflight < cap else None
        # An excluded engine (one this request already failed on) is used only when no other is healthy;
        # a busy other engine is worth waiting for.
        candidates = [r for r in healthy if r.engine_id not in exclude] or healthy
        free = [r for r in candidates if (cap := self.max_inflight_per_engine or r.capacity) is None
                or r.inflight < cap]
        # Least outstanding first; ties go to the engine that has served fewer requests.
        return min(free, key=lambda r: (r.inflight, r.requests_served, r.index), default=None)

    async def release(self, lease: EngineLease, *, ok: bool, error: str = "") -> None:
        """End a request reserved by `acquire`. A failure counts toward declaring the engine dead.

        `ok=False` with an empty `error` is a request given up without blaming the engine (an abort).
        """
        rec = lease.record
        if lease.incarnation != rec.incarnation:
            # The engine was replaced while this request ran: it belongs to the dead incarnation.
            if error:
                self.failed_requests += 1
            await self._notify()
            return
        rec.inflight -= 1
        if ok:
            rec.requests_served += 1
            rec.request_failures = 0
        elif error:
            self.failed_requests += 1
            rec.request_failures += 1
            rec.last_error = error
            if rec.state is EngineState.HEALTHY and rec.request_failures >= self.cfg.failure_threshold:
                self._declare_dead(rec, f"{rec.request_failures} failed requests, last: {error}")
        await self._notify()

    def record_retry(self) -> None:
        """Count one request re-sent after a failure (the manager calls this)."""
        self.retried_requests += 1

    # -------------------------------------------------------------- health checks

    async def check_health(self) -> None:
        """Probe every healthy or stale engine once (concurrently) and apply the failure threshold.

        An engine that completed a request since the last round began is alive without a probe. SGLang's
        `/health_generate` answers a second after it is sent at the earliest, and a colocated engine's sleep
        waits for the probes in flight (each a generation on the engine): probing engines that had just
        served put up to a second into about a third of a hand-off's engine sleeps, right after generation.
        A probe failing while the engine completes a request passes: a saturated engine (or this client's
        busy loop: the timeout runs from submission) answers late, yet the request proves it alive."""
        live = [r for r in self.records if r.state in LIVE and not r.in_weight_update]
        busy = {id(r) for r in live if r.requests_served > r.served_at_check}
        for rec in live:
            rec.served_at_check = rec.requests_served
        timeout_s = self.cfg.health_timeout_s
        checked = await probe_live([r for r in live if id(r) not in busy], timeout_s)
        checked += [(r, True) for r in live if id(r) in busy and r.state in LIVE]
        # Probed or not, an engine is alive if it answered or completed a request while the round ran.
        alive = {id(rec): rec for rec, ok in checked if ok or rec.requests_served > rec.served_at_check}
        restarted = {id(rec) for rec in await restarted_among(list(alive.values()), timeout_s)}
        for rec, _ in checked:
            if rec.in_weight_update or rec.state not in LIVE:
                continue  # a push paused it while the probe waited, or a failed request declared it dead
            if id(rec) in restarted:
                self._declare_dead(rec, rec.last_error)
            elif id(rec) in alive:
                rec.health_failures = 0
            else:
                self.failed_health_checks += 1
                rec.health_failures += 1
                if rec.health_failures >= self.cfg.failure_threshold:
                    self._declare_dead(rec, f"{rec.health_failures} failed health checks: {rec.last_error}")

    async def confirm_dead(self, records: Sequence[EngineRecord]) -> list[EngineRecord]:
        """Health-check `records` now, outside the schedule; declare dead and return those that fail.

        For a caller whose request failed on several engines at once (a weight push): an engine that
        also fails its health check died, and so did one whose address answers from a new process (its
        pod was recreated); one that passes both is alive and the failure was something else.
        """
        checked = await probe_live(records, self.cfg.health_timeout_s)
        new = await self.drop_restarted([r for r, ok in checked if ok], pushed=self.current_version)
        failed = [rec for rec, ok in checked if not ok and rec.state in LIVE]
        for rec in failed:
            self._declare_dead(rec, f"failed a health check after a failed weight push: {rec.last_error}")
        return failed + new

    async def drop_restarted(self, records: Sequence[EngineRecord], *, pushed: str | None = None
                             ) -> list[EngineRecord]:
        """Declare dead and return the `records` whose address answers from a new process (a pod recreated
        under its name since the last health check; one `/model_info` each, concurrently). `pushed`: asked
        after a failed push of that version (see `engine_health.restarted`).

        Asked before a push too: the new process is in no weight-update group, and the group member it
        replaced is gone, so the push would fail only when its surviving members' receive times out.
        """
        new = [rec for rec in await restarted_among(records, self.cfg.health_timeout_s, pushed=pushed)
               if rec.state in LIVE]
        for rec in new:
            self._declare_dead(rec, rec.last_error)
        return new

    def begin_weight_update(self, records: Sequence[EngineRecord]) -> None:
        """Exempt `records` from health checks while a push pauses them and loads their weights.

        A paused engine answers `/health_generate` only after it resumes, and a large load blocks it
        for longer than `failure_threshold` checks take: without this a push would get it declared dead.
        """
        for rec in records:
            rec.in_weight_update = True

    def end_weight_update(self, records: Sequence[EngineRecord], *, answered: bool) -> None:
        """Health checks resume for `records`; `answered`: the push completed on them (they are alive)."""
        for rec in records:
            rec.in_weight_update = False
            if answered:
                rec.health_failures = 0

    def start_health_checks(self) -> None:
        """Run `check_health` every `health_interval_s` in a background task (idempotent)."""
        if self._health_task is None or self._health_task.done():
            self._health_task = asyncio.ensure_future(self._health_loop())

    async def stop_health_checks(self) -> None:
        task, self._health_task = self._health_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _health_loop(self) -> None:
        while not self._closed:
            try:
                await self.check_health()
            except Exception:  # the loop must outlive one bad round
                logger.exception("health check round failed")
            await asyncio.sleep(self.cfg.health_interval_s)  # the check period itself, not a readiness wait

    # ---------------------------------------------------------------- replacement

    def _declare_dead(self, rec: EngineRecord, reason: str) -> None:
        self._set_state(rec, EngineState.DEAD, reason)
        self._after_death(rec)

    def _after_death(self, rec: EngineRecord) -> None:
        if self.auto_replace and not self._closed:
            self._spawn(self._replace(rec))

    def mark_synced(self, engine: str | RolloutEngine | EngineRecord, version: str) -> bool:
        """Record that `engine` now serves weight `version`; returns whether it is healthy.

        A healthy engine's push defines the fleet's current version. A stale engine becomes
        healthy only when `version` equals the current version (set it first with
        `set_current_version` when the stale engine is pushed before the others).
        """
        rec = self.by_id(engine)
        rec.version = version
        if rec.state is EngineState.HEALTHY:
            self.current_version = version
        elif rec.state is EngineState.STALE and version == self.current_version:
            self._set_state(rec, EngineState.HEALTHY, f"weights synced to version {version!r}")
        return rec.state is EngineState.HEALTHY

    def set_current_version(self, version: str) -> None:
        """The version every serving engine must have (call before pushing a new version)."""
        self.current_version = version
