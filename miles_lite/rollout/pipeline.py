"""One step's rollouts, possibly generated while the trainer trains the step before (one-step-off async).

`RolloutPipeline` runs one `RolloutManager.generate_groups` call at a time on the rollout event-loop
thread and lets the driver thread do other work (train, checkpoint) meanwhile. Its lifecycle::

    idle --start--> generating --pause--> paused --resume--> generating --collect--> idle
                         \\------------------------------------------------collect--> idle
    any --close--> closed

`pause()` is how a weight push and a running generation meet. An engine reports one weight version
per request, so a request held inside an engine across a push would label its older tokens with the
newer version. The pipeline therefore aborts the running call at a token boundary instead: complete
groups are kept, every unfinished completion keeps its partial tokens (each run of tokens tagged with
the version that wrote it), and `resume()` after the push lets them continue on the new weights. The
manager records such completions as mixed-version samples ("3+4").
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Sequence
from concurrent import futures
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from miles_lite.rollout.manager import PromptSource as RefillSource
from miles_lite.rollout.manager import RolloutManager, RolloutStats, Scorer
from miles_lite.rollout.prompt_spec import PromptLike, as_prompt_spec
from miles_lite.rollout.sync_api import EventLoopThread
from miles_lite.types import Group


class PipelineState(enum.Enum):
    IDLE = "idle"
    GENERATING = "generating"
    PAUSED = "paused"
    CLOSED = "closed"


_TRANSITIONS: dict[PipelineState, frozenset[PipelineState]] = {
    PipelineState.IDLE: frozenset({PipelineState.GENERATING, PipelineState.CLOSED}),
    PipelineState.GENERATING: frozenset({PipelineState.PAUSED, PipelineState.IDLE, PipelineState.CLOSED}),
    PipelineState.PAUSED: frozenset({PipelineState.GENERATING, PipelineState.CLOSED}),
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
    out.carried_groups = parts[-1].carried_groups if parts else 0
    return out


@dataclass
class _Batch:
    order: dict[int, int]
    tag: Any
    target: int
    groups: list[Group] = field(default_factory=list)
    stats: list[RolloutStats] = field(default_factory=list)
    pauses: int = 0


class RolloutPipeline:
    """Runs the manager's calls on `loop` in the background; see the module docstring.

    Args:
        manager: the rollout manager (its fleet lives on `loop`).
        loop: the rollout event-loop thread.
        group_size: completions per prompt.
        timeout_s: how long `collect`/`pause` wait for the loop before raising (None: no limit).
        scorer / more_prompts: with `rollout.dynamic_sampling`, score groups as they complete and draw
            fresh prompts to refill the zero-signal ones (see `RolloutManager.generate_groups`); the batch
            of one `start` keeps its size and its rounds bound across pauses.
    """

    def __init__(self, manager: RolloutManager, loop: EventLoopThread, group_size: int,
                 timeout_s: float | None = None, *, scorer: Scorer | None = None,
                 more_prompts: RefillSource | None = None) -> None:
        if group_size < 1:
            raise ValueError(f"rollout.group_size must be >= 1, got {group_size}")
        self.manager = manager
        self.loop = loop
        self.group_size = group_size
        self.timeout_s = timeout_s
        self.scorer = scorer
        self.more_prompts = more_prompts
        self.state = PipelineState.IDLE
        self._batch: _Batch | None = None
        self._future: Future[list[Group]] | None = None

    def _move(self, new: PipelineState) -> None:
        if new not in _TRANSITIONS[self.state]:
            raise RuntimeError(f"rollout pipeline: {self.state.value} -> {new.value} is not allowed; from "
                               f"{self.state.value} it may go to {sorted(s.value for s in _TRANSITIONS[self.state])}")
        self.state = new

    @property
    def busy(self) -> bool:
        """Whether a batch was started and not yet collected."""
        return self.state in (PipelineState.GENERATING, PipelineState.PAUSED)

    @property
    def tag(self) -> Any:
        """The `tag` of the batch started and not yet collected (None when idle)."""
        return self._batch.tag if self._batch is not None else None

    def wait(self, timeout_s: float) -> bool:
        """Block until the running manager call has returned, without collecting it; False on timeout."""
        if self._future is None:
            return True
        done, _ = futures.wait([self._future], timeout_s)
        return bool(done)

    def start(self, prompts: Sequence[PromptLike], tag: Any = None) -> None:
        """Begin generating `group_size` completions for each prompt; returns at once."""
        self._move(PipelineState.GENERATING)
        specs = [as_prompt_spec(p) for p in prompts]
        order: dict[int, int] = {}
        for position, spec in enumerate(specs):
            order.setdefault(spec.prompt_index, position)
        self._batch = _Batch(order, tag, target=len(specs))
        self._submit(specs)

    def _submit(self, prompts: Sequence[PromptLike], finish_only: bool = False) -> None:
        """Run one manager call. After a pause it continues the batch: the groups still missing, within the
        sampling rounds left; `finish_only` completes the carried partials and refills nothing."""
        assert self._batch is not None
        batch = self._batch
        rounds_used = sum(s.sampling_rounds for s in batch.stats)
        target = 0 if finish_only else batch.target - len(batch.groups)
        rounds = 1 if finish_only else self.manager.cfg.max_sampling_rounds - rounds_used
        call = self.manager.generate_groups(prompts, self.group_size, scorer=self.scorer,
                                            more_prompts=self.more_prompts, target=target, max_rounds=rounds)
        # Submitted FIFO to the loop: the call is running before any later pause()/abort reaches it.
        self._future = asyncio.run_coroutine_threadsafe(call, self.loop.loop)

    def _take(self) -> None:
        """Move the finished manager call's groups and stats into the batch."""
        assert self._future is not None and self._batch is not None
        groups = self._future.result(self.timeout_s)
        self._future = None
        self._batch.groups.extend(groups)
        self._batch.stats.append(self.manager.last_stats)

    def pause(self) -> None:
        """Stop generating before a weight push; a no-op unless generating.

        A finished call is simply taken. A running one is aborted: complete groups are kept and the
        unfinished ones stay with the manager, partial tokens included, until `resume()`.
        """
        if self.state is not PipelineState.GENERATING or self._future is None:
            return
        assert self._batch is not None
        if not self._future.done():
            self.loop.run(self.manager.abort(), self.timeout_s)
        self._take()
        if self.manager.pending_groups:
            self._batch.pauses += 1
            self._move(PipelineState.PAUSED)
        else:
            self._future = None

    def resume(self) -> None:
        """After a weight push: unfinished completions continue on the engines' current weights."""
        if self.state is not PipelineState.PAUSED:
            return
        self._move(PipelineState.GENERATING)
        self._submit([])

    def collect(self) -> PipelineResult:
        """Wait for the started batch and return it; raises what the manager raised."""
        if self.state is PipelineState.PAUSED:
            self.resume()
        if self.state is not PipelineState.GENERATING:
            raise RuntimeError(f"rollout pipeline is {self.state.value}: call start() before collect()")
        assert self._batch is not None
        if self._future is not None:
            self._take()
        batch, self._batch = self._batch, None
        self._move(PipelineState.IDLE)
        groups = sorted(batch.groups, key=lambda g: batch.order.get(g.prompt_index, len(batch.order)))
        return PipelineResult(groups, merge_stats(batch.stats), batch.pauses, batch.tag)

    def close(self) -> Any:
        """Abandon a batch still in flight (the run stops between steps); returns its `tag`.

        Partial completions are finished and discarded so the manager holds nothing that a later
        call (an evaluation) would receive. Idempotent.
        """
        if self.state is PipelineState.CLOSED:
            return None
        tag = self.tag
        if self.busy:
            self.pause()
            if self.manager.pending_groups:
                self._submit([], finish_only=True)
                self._take()
        self._batch = self._future = None
        self._move(PipelineState.CLOSED)
        return tag
