"""Sleep and wake of a fleet's engines: the memory hand-over of colocated roles, on the fleet's state machine.

`sleep(tags)` releases memory on every healthy engine (healthy -> sleeping); `wake(tags)` resumes it, and
an engine with nothing released left serves again (sleeping -> healthy). A weight push to sleeping
engines goes: wake `weights` -> push -> wake the rest (`FleetPusher`). Sleeping engines are not
health-checked (an SGLang engine without its KV cache cannot answer `/health_generate`); one that fails
to resume is declared dead and replaced. A request while every engine sleeps is refused at once
(`FleetAsleep`), naming what to do.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from miles_lite.rollout.engine import MEMORY_TAGS, EngineError
from miles_lite.rollout.engine_state import EngineRecord, EngineState

# States in which an engine serves or will serve without being woken.
_SERVING_OR_COMING = (EngineState.HEALTHY, EngineState.STARTING, EngineState.REPLACING, EngineState.STALE)


class FleetMemory:
    """Sleep/wake of `EngineFleet` (a mixin: it uses the fleet's records and transitions)."""

    records: list[EngineRecord]
    _set_state: Callable[[EngineRecord, EngineState, str], None]
    _declare_dead: Callable[[EngineRecord, str], None]

    def sleeping(self) -> list[EngineRecord]:
        """The engines that have released memory."""
        return [r for r in self.records if r.state is EngineState.SLEEPING]

    def asleep(self) -> bool:
        """Some engine sleeps and none serves or is about to: a request can only wait for a wake."""
        return bool(self.sleeping()) and not any(r.state in _SERVING_OR_COMING for r in self.records)

    async def sleep(self, tags: Sequence[str] = MEMORY_TAGS) -> list[EngineRecord]:
        """Release `tags` on every healthy engine; the engines now sleeping.

        Raises ValueError while a request is in flight (SGLang releases memory only when idle), and
        EngineError naming the engines that refused (those stay healthy).
        """
        tags = _checked(tags)
        healthy = [r for r in self.records if r.state is EngineState.HEALTHY]
        busy = {r.engine_id: r.inflight for r in healthy if r.inflight}
        if busy:
            raise ValueError(f"cannot release engine memory with requests in flight {busy}; finish or abort them")
        results = await asyncio.gather(*(r.engine.release_memory(tags) for r in healthy), return_exceptions=True)
        refused = []
        for rec, result in zip(healthy, results, strict=True):
            if isinstance(result, BaseException):
                rec.last_error = f"release_memory{tags}: {result}"
                refused.append(rec)
            elif rec.state is EngineState.HEALTHY:  # not declared dead meanwhile
                rec.released = frozenset(tags)
                self._set_state(rec, EngineState.SLEEPING, f"released memory {tags}")
        if refused:
            raise EngineError("engines refused to release memory: "
                              + "; ".join(f"{r.engine_id}: {r.last_error}" for r in refused))
        return self.sleeping()

    async def wake(self, tags: Sequence[str] = MEMORY_TAGS,
                   records: Sequence[EngineRecord] | None = None) -> list[EngineRecord]:
        """Resume `tags` (those each engine released) on the sleeping engines of `records` (default: all);
        an engine with nothing released left becomes healthy. Returns the engines that resumed; one that
        fails to resume is declared dead (its replacement comes up stale and gets the next push)."""
        tags = _checked(tags)
        targets = [r for r in (self.records if records is None else records)
                   if r.state is EngineState.SLEEPING and r.released & set(tags)]
        asked = [[t for t in MEMORY_TAGS if t in tags and t in r.released] for r in targets]
        results = await asyncio.gather(*(r.engine.resume_memory(t) for r, t in zip(targets, asked, strict=True)),
                                       return_exceptions=True)
        resumed = []
        for rec, wanted, result in zip(targets, asked, results, strict=True):
            if rec.state is not EngineState.SLEEPING:
                continue
            if isinstance(result, BaseException):
                rec.last_error = f"resume_memory{wanted}: {result}"
                self._declare_dead(rec, f"failed to resume its memory: {result}")
                continue
            rec.released = rec.released - set(wanted)
            resumed.append(rec)
            if not rec.released:
                rec.health_failures = rec.request_failures = 0
                self._set_state(rec, EngineState.HEALTHY, f"resumed memory {wanted}")
        return resumed


def _checked(tags: Sequence[str]) -> list[str]:
    tags = list(dict.fromkeys(tags))
    unknown = [t for t in tags if t not in MEMORY_TAGS]
    if not tags or unknown:
        raise ValueError(f"memory tags must be a non-empty subset of {MEMORY_TAGS}, got {tags}")
    return tags
