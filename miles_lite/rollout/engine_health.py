"""Asking engines whether they are alive: one bounded `/health_generate` probe per engine.

The fleet (`rollout/fleet.py`) decides what an answer means (failure threshold, engines paused by a push,
requests completed meanwhile); this module only asks and records why an engine did not answer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from miles_lite.rollout.engine_state import EngineRecord, EngineState

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
