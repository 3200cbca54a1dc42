"""Running one model turn of a session on the fleet: the manager's request machinery (retries on another
engine after a failure, partial output kept and continued after an abort) with sticky routing: a session's
turns go to the engine that served its previous turn while that engine is healthy (its prefix cache holds
the session's ids), else to the least loaded one, which receives the session's whole stored ids
(`Session.engine_moves` counts the moves)."""

from __future__ import annotations

import itertools
from typing import Any

from miles_lite.rollout.gateway.session import Session
from miles_lite.rollout.generate_plugin import Interrupted
from miles_lite.rollout.slots import ManagerState, RolloutStats, Slot, joined
from miles_lite.types import Generation, PromptSpec, SamplingParams


class TurnRunner:
    """Generates sessions' turns through `manager` (a `RolloutManager`: its fleet, timeouts and retry policy).

    A session of an agent the manager runs (`interruptible`) stops with `Interrupted` when the manager stops for
    a weight update; other sessions (opened by a client through `POST /sessions`) run whenever the fleet serves.
    """

    def __init__(self, manager: Any) -> None:
        self.manager = manager
        self.stats = RolloutStats()  # turns of sessions opened by clients (the manager's calls count their own)
        self._ids = itertools.count()

    async def generate(self, session: Session, input_ids: list[int], sampling: SamplingParams, *,
                       interruptible: bool, stats: RolloutStats | None = None) -> Generation:
        manager = self.manager
        stats = stats if stats is not None else self.stats
        scratch = Slot(next(self._ids), sampling.seed)
        spec = PromptSpec(session.prompt_index, tuple(input_ids), question=f"session {session.id}")
        while not scratch.done:
            remaining = sampling.max_new_tokens - len(scratch.response_ids)
            if remaining <= 0:
                scratch.finish_reason = "length"
                break
            if interruptible and manager.state is not ManagerState.RUNNING:
                raise Interrupted
            lease = await manager.fleet.acquire(frozenset(scratch.failed_on), timeout_s=manager.cfg.request_timeout_s,
                                                prefer=session.engine)
            if session.engine is not None and lease.engine_id != session.engine:
                session.engine_moves += 1
            session.engine = lease.engine_id
            scratch.in_request = True
            try:
                if interruptible and manager.state is not ManagerState.RUNNING:
                    await manager.fleet.release(lease, ok=False)
                    raise Interrupted
                await manager._request(spec, sampling, scratch, lease, remaining, stats)
            finally:
                scratch.in_request = False
        return Generation(tuple(scratch.response_ids), tuple(scratch.logprobs), scratch.finish_reason,
                          joined(scratch.versions), joined(scratch.engines), routed_experts=scratch.routed)
