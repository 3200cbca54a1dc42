"""Asking engines whether they are alive (one bounded `/health_generate` probe each), what they serve and
whether the process at an address is still the one admitted there.

The fleet (`rollout/fleet.py`) decides what an answer means (failure threshold, engines paused by a push,
requests completed meanwhile, what to do with a restarted engine); this module asks and records why an
engine did not answer, or why it is taken for a new process.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from miles_lite.rollout.engine_state import EngineRecord, EngineState, engine_capacity

# Engines whose health is checked: serving ones, and replacements waiting for weights.
LIVE = (EngineState.HEALTHY, EngineState.STALE)


async def probe(rec: EngineRecord, timeout_s: float) -> bool:
    """Whether `rec`'s engine answers healthy within `timeout_s`; a failure is kept in `rec.last_error`."""
    try:
        ok = await asyncio.wait_for(rec.engine.health(timeout_s), timeout_s)
    except Exception as exc:  # any failure to answer is a failed check
        rec.last_error = f"health check: {exc!r}"
        return False
    if not ok:
        rec.last_error = "health check answered unhealthy"
    return bool(ok)


async def probe_live(records: Sequence[EngineRecord], timeout_s: float) -> list[tuple[EngineRecord, bool]]:
    """Probe the healthy or stale `records` concurrently; (record, answered) for those still so after."""
    candidates = [r for r in records if r.state in LIVE]
    results = await asyncio.gather(*(probe(r, timeout_s) for r in candidates))
    # An engine declared dead by a failed request while the probe ran is left out.
    return [(rec, ok) for rec, ok in zip(candidates, results, strict=True) if rec.state in LIVE]


async def reported_version(rec: EngineRecord, timeout_s: float) -> str:
    """The weight version `rec`'s engine serves; "" (unknown) when it cannot say."""
    try:
        return str(await asyncio.wait_for(rec.engine.weight_version(), timeout_s))
    except Exception as exc:  # an engine that cannot say its version is treated as unknown
        rec.last_error = f"weight_version failed: {exc!r}"
        return ""


async def reported_capacity(rec: EngineRecord, timeout_s: float) -> int | None:
    """The engine's concurrent-request capacity from `/get_server_info`; None when it says none."""
    info = getattr(rec.engine, "server_info", None)
    if info is None:
        return None
    try:
        return engine_capacity(await asyncio.wait_for(info(), timeout_s))
    except Exception as exc:  # no capacity known: the engine's own queue takes what it cannot run
        rec.last_error = f"server_info failed: {exc!r}"
        return None


async def restarted(rec: EngineRecord, timeout_s: float, *, pushed: str | None = None) -> bool:
    """Whether the server at `rec`'s address is no longer the process the fleet admitted there.

    A pod recreated under the same name answers health checks at its address before they ever fail, but
    serves its initial weights and knows no weight-update group: it reports a weight version other than
    the one recorded for the engine. Asked of healthy engines outside a push; `pushed`: asked after a
    failed push of that version, which the engine may report too. An answer that arrives after the record
    changed (a push landed meanwhile) says nothing, nor does a failure to answer (the health probe judges
    that). The reason is kept in `rec.last_error`. Only engines something else starts (attached by URL, pods,
    Ray actors) can be replaced this way: a local child's address answers from no other process, so it is not
    asked (one version query less per push and per health check).
    """
    if rec.handle.local_child:
        return False
    recorded = rec.version

    def comparable() -> bool:
        return (rec.state is EngineState.HEALTHY and rec.version == recorded
                and (pushed is not None or not rec.in_weight_update))

    if not recorded or not comparable():
        return False
    reported = await reported_version(rec, timeout_s)
    if not reported or not comparable() or reported in (recorded, pushed):  # unanswered: no evidence
        return False
    rec.last_error = (f"restarted behind the fleet: the server at its address reports weight version {reported!r}, "
                      f"the engine admitted there served {recorded!r}")
    return True


async def restarted_among(records: Sequence[EngineRecord], timeout_s: float, *,
                          pushed: str | None = None) -> list[EngineRecord]:
    """The `records` whose address now answers from a new process (see `restarted`), asked concurrently."""
    found = await asyncio.gather(*(restarted(r, timeout_s, pushed=pushed) for r in records))
    return [rec for rec, yes in zip(records, found, strict=True) if yes]
