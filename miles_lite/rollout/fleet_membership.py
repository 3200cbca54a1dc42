"""Engines joining and leaving a running fleet: replacements of dead engines, engines added while the job runs,
and engines retired for good (scaled away). A mixin of `EngineFleet`, which holds the state it works on."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from miles_lite.config.schema import FaultToleranceConfig
from miles_lite.rollout.engine import RolloutEngine
from miles_lite.rollout.engine_health import probe, reported_version
from miles_lite.rollout.engine_state import ALREADY_CURRENT, EngineHandle, EngineRecord, EngineState, Launcher

logger = logging.getLogger("miles_lite.rollout.fleet")

# Seconds a dead engine's diagnosis (`EngineHandle.diagnose`: its processes' stacks) may hold up its replacement.
DIAGNOSE_TIMEOUT_S = 30.0


class FleetMembership:
    """Replacement, admission and retirement of engine slots (see `EngineFleet`)."""

    cfg: FaultToleranceConfig
    launcher: Launcher | None
    records: list[EngineRecord]
    restarts: int
    current_version: str | None
    _closed: bool
    _set_state: Callable[[EngineRecord, EngineState, str], None]
    _after_death: Callable[[EngineRecord], None]
    _stop_engine: Callable[[EngineRecord], Awaitable[None]]
    _notify: Callable[[], Awaitable[None]]
    by_id: Callable[[str | RolloutEngine | EngineRecord], EngineRecord]

    async def admit(self, handle: EngineHandle) -> EngineRecord:
        """Add an engine to a running fleet: it serves at once when it holds the current weights, else it
        waits as stale for the next push (an engine added while training does not serve old weights)."""
        rec = EngineRecord(index=len(self.records), handle=handle)
        self.records.append(rec)
        answered = await probe(rec, self.cfg.health_timeout_s)
        if rec.state is EngineState.RETIRED:
            return rec
        if not answered:
            self._set_state(rec, EngineState.DEAD, f"first health check failed: {rec.last_error}")
            self._after_death(rec)
            return rec
        rec.version = await reported_version(rec, self.cfg.health_timeout_s)
        if rec.state is EngineState.RETIRED:
            return rec
        if self.current_version is None or rec.version == self.current_version:
            self.current_version = self.current_version or rec.version
            self._set_state(rec, EngineState.HEALTHY, f"added, serving weight version {rec.version!r}")
        else:
            self._set_state(rec, EngineState.STALE, f"added with weight version {rec.version!r}")
        return rec

    async def retire(self, engine: str | RolloutEngine | EngineRecord, reason: str) -> None:
        """Remove an engine from the fleet for good (it was scaled away): no request, push or replacement."""
        rec = self.by_id(engine)
        if rec.state is EngineState.RETIRED:
            return
        self._set_state(rec, EngineState.RETIRED, reason)
        await self._stop_engine(rec)

    async def replace_dead(self) -> None:
        """Replace every dead engine now, while restarts remain (used with `auto_replace=False`)."""
        await asyncio.gather(*(self._replace(r) for r in self.records if r.state is EngineState.DEAD))

    async def _diagnose(self, rec: EngineRecord) -> None:
        """Before a dead engine's server is stopped: its handle records what the server's processes were doing
        (`EngineHandle.diagnose`; once per server, within `DIAGNOSE_TIMEOUT_S`). A hang that stops answering
        leaves nothing in the engine's log; its stacks name where it waits."""
        diagnose, rec.handle.diagnose = rec.handle.diagnose, None
        if diagnose is None or rec.handle.stop is None:  # nothing to record, or the server was stopped already
            return
        try:
            where = await asyncio.wait_for(diagnose(rec.last_error), DIAGNOSE_TIMEOUT_S)
        except Exception as exc:  # the replacement must not wait on a failed look (a lost node's actor, a timeout)
            logger.warning("engine slot %d: recording what its dead server was doing failed: %r", rec.index, exc)
            return
        if where is not None:
            logger.warning("engine %s declared dead (%s); what its processes were doing: %s", rec.engine_id,
                           rec.last_error, where)

    async def _replace(self, rec: EngineRecord) -> None:
        await self._diagnose(rec)
        while rec.state is EngineState.DEAD and not self._closed:
            if self.launcher is None or self.restarts >= self.cfg.max_engine_restarts:
                logger.warning("engine slot %d stays dead: restarts used %d/%d", rec.index, self.restarts,
                               self.cfg.max_engine_restarts)
                await self._stop_engine(rec)
                await self._notify()
                return
            self.restarts += 1
            rec.incarnation += 1
            self._set_state(rec, EngineState.REPLACING, f"restart {self.restarts}/{self.cfg.max_engine_restarts}")
            await self._stop_engine(rec)
            try:
                handle = await self.launcher(rec.index, rec.incarnation)
            except Exception as exc:  # a failed launch uses up the restart and may be tried again
                if rec.state is EngineState.RETIRED:
                    self.restarts -= 1  # removed from the fleet meanwhile: nothing was replaced
                    return
                rec.last_error = f"launch failed: {exc!r}"
                self._set_state(rec, EngineState.DEAD, rec.last_error)
                continue
            if rec.state is EngineState.RETIRED:
                self.restarts -= 1
                rec.handle = handle
                await self._stop_engine(rec)
                return
            rec.handle = handle
            rec.health_failures = rec.request_failures = rec.inflight = 0
            await self._come_up_stale(rec)

    async def _come_up_stale(self, rec: EngineRecord) -> None:
        answered = await probe(rec, self.cfg.health_timeout_s)
        if rec.state is EngineState.RETIRED:
            return
        if not answered:
            self._set_state(rec, EngineState.DEAD, f"replacement failed its first health check: {rec.last_error}")
            return
        rec.version = await reported_version(rec, self.cfg.health_timeout_s)
        if rec.state is EngineState.RETIRED:
            return
        self._set_state(rec, EngineState.STALE, f"replacement up with weight version {rec.version!r}")
        if rec.version and rec.version == self.current_version:
            # Started from the weights the fleet serves (no push since the start): nothing to wait for.
            self._set_state(rec, EngineState.HEALTHY, f"{ALREADY_CURRENT} {rec.version!r}")
