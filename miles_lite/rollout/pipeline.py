"""Rollout batches generated ahead of training: synchronous, one-step-off or N-step-off async.

`RolloutPipeline` keeps a FIFO of started batches (one batch = one step's prompts). A worker task on the
rollout event-loop thread generates them one after another, each through `RolloutManager.generate_groups`,
while the driver thread trains; `collect()` hands back the oldest batch once it is complete. With
`rollout.async_steps=N` the driver keeps up to N batches started beyond the one it trains on, so
generation runs up to N weight versions ahead. Lifecycle of the pipeline::

    idle --start--> generating --pause--> paused --resume--> generating --collect (last batch)--> idle
    generating --start / collect (more batches left)--> generating
    any --close--> closed

`pause()` is how a weight push and generation meet. An engine reports one weight version per request,
so a request held inside an engine across a push would label its older tokens with the newer version.
The pipeline therefore aborts the running call at a token boundary instead and holds the worker: complete
groups are kept, every unfinished completion keeps its partial tokens (each run of tokens tagged with the
version that wrote it), and `resume()` after the push lets them continue on the new weights before the
next batch starts. The manager records such completions as mixed-version samples ("3+4").
"""

from __future__ import annotations

import asyncio
import enum
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from miles_lite.rollout.manager import ManagerState, RolloutManager, RolloutStats, Scorer
from miles_lite.rollout.manager import PromptSource as RefillSource
from miles_lite.rollout.prompt_spec import PromptLike, PromptSpec, as_prompt_spec
from miles_lite.rollout.slots import AGENT_COUNTERS
from miles_lite.rollout.starvation import StarvationRelay
from miles_lite.rollout.sync_api import EventLoopThread
from miles_lite.types import Group


class PipelineState(enum.Enum):
    IDLE = "idle"
    GENERATING = "generating"
    PAUSED = "paused"
    CLOSED = "closed"


_TRANSITIONS: dict[PipelineState, frozenset[PipelineState]] = {
    PipelineState.IDLE: frozenset({PipelineState.GENERATING, PipelineState.CLOSED}),
    PipelineState.GENERATING: frozenset({PipelineState.GENERATING, PipelineState.PAUSED, PipelineState.IDLE,
                                         PipelineState.CLOSED}),
    PipelineState.PAUSED: frozenset({PipelineState.PAUSED, PipelineState.GENERATING, PipelineState.CLOSED}),
    PipelineState.CLOSED: frozenset(),
}


@dataclass
class PipelineResult:
    """The groups of one `start` (in prompt order) and the stats of every manager call that made them.

    `tag` is what `start` was given (e.g. the prompt cursor before the prompts were drawn).
    """

    groups: list[Group]
    stats: RolloutStats
    pauses: int = 0
    tag: Any = None


def merge_stats(parts: Sequence[RolloutStats]) -> RolloutStats:
    """Sum the counters and wall times of several manager calls that together made one batch."""
    out = RolloutStats()
    for s in parts:
        out.requests += s.requests
        out.tokens_generated += s.tokens_generated
        out.wall_s += s.wall_s
        out.latencies_s.extend(s.latencies_s)
        out.retries += s.retries
        for engine, n in s.engines_used.items():
            out.engines_used[engine] = out.engines_used.get(engine, 0) + n
        out.sampling_rounds += s.sampling_rounds
        out.dropped_groups += s.dropped_groups
        out.refill_prompts += s.refill_prompts
        out.resumed_partials += s.resumed_partials
        out.aborted = out.aborted or s.aborted
        for name in AGENT_COUNTERS:
            setattr(out, name, getattr(out, name) + getattr(s, name))
    out.carried_groups = parts[-1].carried_groups if parts else 0
    return out


@dataclass
class _Batch:
    """One started batch; its fields are touched on the event-loop thread only (the worker, or a coroutine
    the driver runs there)."""

    specs: list[PromptSpec]
    order: dict[int, int]
    tag: Any
    target: int
    done: asyncio.Event
    groups: list[Group] = field(default_factory=list)
    stats: list[RolloutStats] = field(default_factory=list)
    pauses: int = 0
    submitted: bool = False
    finished: bool = False
    error: BaseException | None = None


class RolloutPipeline:
    """Generates started batches in order on `loop`, in the background; see the module docstring.

    Args:
        manager: the rollout manager (its fleet lives on `loop`).
        loop: the rollout event-loop thread.
        group_size: completions per prompt.
        timeout_s: how long `collect`/`pause` wait for the loop before raising (None: no limit).
        scorer / more_prompts: with `rollout.dynamic_sampling`, score groups as they complete and draw
            fresh prompts to refill the zero-signal ones (see `RolloutManager.generate_groups`); a batch
            keeps its size and its rounds bound across pauses.
        relay: while `collect`/`wait` block, push the current weights to stale engines when the fleet is
            starved (see `miles_lite.rollout.starvation`); None: they only wait.
    """

    def __init__(self, manager: RolloutManager, loop: EventLoopThread, group_size: int,
                 timeout_s: float | None = None, *, scorer: Scorer | None = None,
                 more_prompts: RefillSource | None = None, relay: StarvationRelay | None = None) -> None:
        if group_size < 1:
            raise ValueError(f"rollout.group_size must be >= 1, got {group_size}")
        self.manager = manager
        self.loop = loop
        self.group_size = group_size
        self.timeout_s = timeout_s
        self.scorer = scorer
        self.more_prompts = more_prompts
        self.relay = relay
        self.state = PipelineState.IDLE
        self._batches: deque[_Batch] = deque()
        self._worker: asyncio.Task[None] | None = None
        self._allowed: asyncio.Event | None = None  # cleared while paused
        self._wake: asyncio.Event | None = None  # a batch was started
        self._waiting: asyncio.Event | None = None  # set while the worker runs no manager call

    def _move(self, new: PipelineState) -> None:
        if new not in _TRANSITIONS[self.state]:
            raise RuntimeError(f"rollout pipeline: {self.state.value} -> {new.value} is not allowed; from "
                               f"{self.state.value} it may go to {sorted(s.value for s in _TRANSITIONS[self.state])}")
        self.state = new

    @property
    def busy(self) -> bool:
        """Whether a batch was started and not yet collected."""
        return bool(self._batches)

    @property
    def pending(self) -> int:
        """Batches started and not yet collected."""
        return len(self._batches)

    @property
    def tag(self) -> Any:
        """The `tag` of the oldest batch started and not yet collected (None when idle)."""
        batches = list(self._batches)
        return batches[0].tag if batches else None

    # ---- driver-thread API -------------------------------------------------------------------

    def start(self, prompts: Sequence[PromptLike], tag: Any = None) -> None:
        """Queue `group_size` completions for each prompt; generation begins when the batches before it are
        done. Returns at once."""
        self._move(PipelineState.PAUSED if self.state is PipelineState.PAUSED else PipelineState.GENERATING)
        specs = [as_prompt_spec(p) for p in prompts]
        order: dict[int, int] = {}
        for position, spec in enumerate(specs):
            order.setdefault(spec.prompt_index, position)
        self.loop.run(self._enqueue(specs, order, tag), self.timeout_s)

    def wait(self, timeout_s: float) -> bool:
        """Block until the oldest batch is generated, without collecting it; False on timeout."""
        if not self._batches:
            return True
        batch = self._batches[0]
        try:
            self.loop.run(asyncio.wait_for(batch.done.wait(), timeout_s), relay=self.relay)
        except TimeoutError:
            return False
        return True

    def pause(self) -> None:
        """Hold generation for a weight push; a no-op unless generating.

        A running manager call is aborted: complete groups are kept and the unfinished ones stay with the
        manager, partial tokens included, until `resume()`. Batches not started yet wait as well. With
        every batch already generated there is nothing to hold and the state stays `generating`.
        """
        if self.state is not PipelineState.GENERATING:
            return
        if self.loop.run(self._hold(), self.timeout_s):
            self._move(PipelineState.PAUSED)

    def resume(self) -> None:
        """After a weight push: unfinished completions continue on the engines' current weights."""
        if self.state is not PipelineState.PAUSED:
            return
        self._move(PipelineState.GENERATING)
        self.loop.run(self._release(), self.timeout_s)

    def collect(self) -> PipelineResult:
        """Wait for the oldest started batch and return it; raises what the manager raised for it."""
        if self.state is PipelineState.PAUSED:
            self.resume()
        if self.state is not PipelineState.GENERATING or not self._batches:
            raise RuntimeError(f"rollout pipeline is {self.state.value}: call start() before collect()")
        batch = self.loop.run(self._pop_oldest(), self.timeout_s, relay=self.relay)
        if not self._batches:
            self._move(PipelineState.IDLE)
        if batch.error is not None:
            raise batch.error
        groups = sorted(batch.groups, key=lambda g: batch.order.get(g.prompt_index, len(batch.order)))
        return PipelineResult(groups, merge_stats(batch.stats), batch.pauses, batch.tag)

    def close(self) -> Any:
        """Abandon every batch still in flight (the run stops between steps); returns the oldest one's `tag`.

        Partial completions are finished and discarded so the manager holds nothing that a later call (an
        evaluation) would receive. Idempotent.
        """
        if self.state is PipelineState.CLOSED:
            return None
        tag = self.tag
        if self._worker is not None:
            self.loop.run(self._shutdown(), self.timeout_s)
        self._batches.clear()
        self._move(PipelineState.CLOSED)
        return tag

    # ---- event-loop side ---------------------------------------------------------------------

    async def _enqueue(self, specs: list[PromptSpec], order: dict[int, int], tag: Any) -> None:
        if self._worker is None:
            self._allowed, self._wake, self._waiting = asyncio.Event(), asyncio.Event(), asyncio.Event()
            if self.state is not PipelineState.PAUSED:
                self._allowed.set()
            self._waiting.set()
            self._worker = asyncio.ensure_future(self._work())
        self._batches.append(_Batch(specs, order, tag, target=len(specs), done=asyncio.Event()))
        assert self._wake is not None
        self._wake.set()

    def _next_unfinished(self) -> _Batch | None:
        return next((b for b in self._batches if not b.finished), None)

    async def _work(self) -> None:
        """Generate the started batches in order, holding while paused."""
        assert self._allowed is not None and self._wake is not None and self._waiting is not None
        while True:
            batch = self._next_unfinished()
            if batch is None or not self._allowed.is_set():
                self._wake.clear()
                if batch is None:
                    await self._wake.wait()
                else:
                    await self._allowed.wait()
                continue
            self._waiting.clear()
            try:
                await self._generate(batch)
            finally:
                self._waiting.set()

    async def _generate(self, batch: _Batch) -> None:
        """One manager call for `batch`: its prompts, or (after a pause) the completions the pause cut."""
        rounds_used = sum(s.sampling_rounds for s in batch.stats)
        prompts = [] if batch.submitted else batch.specs
        batch.submitted = True
        try:
            groups = await self.manager.generate_groups(
                prompts, self.group_size, scorer=self.scorer, more_prompts=self.more_prompts,
                target=batch.target - len(batch.groups),
                max_rounds=self.manager.cfg.max_sampling_rounds - rounds_used)
        except Exception as err:  # surfaces in collect(), on the driver thread
            batch.error, batch.finished = err, True
            batch.done.set()
            return
        batch.groups.extend(groups)
        batch.stats.append(self.manager.last_stats)
        if self.manager.pending_groups:  # cut by a pause: the rest follows on the next weights
            batch.pauses += 1
            return
        batch.finished = True
        batch.done.set()

    async def _hold(self) -> bool:
        """Stop the worker before its next call, aborting the running one; True if anything is left to do."""
        assert self._allowed is not None and self._waiting is not None
        self._allowed.clear()
        if self.manager.state is not ManagerState.IDLE:
            await self.manager.abort()
        await self._waiting.wait()
        if self._next_unfinished() is None:
            self._allowed.set()  # nothing to hold: batches started later may run at once
            return False
        return True

    async def _release(self) -> None:
        assert self._allowed is not None
        self._allowed.set()

    async def _pop_oldest(self) -> _Batch:
        batch = self._batches[0]
        await batch.done.wait()
        return self._batches.popleft()

    async def _shutdown(self) -> None:
        if self._allowed is not None:
            await self._hold()
        assert self._worker is not None
        self._worker.cancel()
        await asyncio.gather(self._worker, return_exceptions=True)
        self._worker = None
        if self.manager.pending_groups:  # finish the cut completions, refill nothing, discard them
            await self.manager.generate_groups([], self.group_size, scorer=self.scorer,
                                               more_prompts=self.more_prompts, target=0, max_rounds=1)
