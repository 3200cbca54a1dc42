"""Rollout plug-in: a generate function named by import path (`rollout.generate_fn=pkg.module:fn`).

The function produces one completion of one prompt, with any number of engine calls in between
(tool use, self-revision, forced prefixes)::

    async def fn(client: RolloutClient, prompt: PromptSpec, sampling: SamplingParams) -> GenerateResult

`client.generate(input_ids, sampling)` runs one request on the fleet with the manager's fault
handling (a failed engine is retried elsewhere) and returns a `Generation`; `client.encode` /
`client.decode` tokenise and detokenise. The result's `loss_mask` marks tokens the function inserted
itself (0: left out of the loss; their log-probs should be 0.0). A completion interrupted by a weight
update is produced again from the start after the update.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from miles_lite.plugins import load_async_fn
from miles_lite.rollout.prompt_spec import PromptSpec
from miles_lite.rollout.slots import ManagerState, RolloutStats, Slot, joined
from miles_lite.types import Generation, SamplingParams


@dataclass(frozen=True)
class GenerateResult:
    """One completion from a generate plug-in; the three lists are aligned (one entry per response token)."""

    response_ids: Sequence[int]
    logprobs: Sequence[float]
    loss_mask: Sequence[int]
    finish_reason: str = "stop"

    def check(self) -> None:
        n = len(self.response_ids)
        if len(self.logprobs) != n or len(self.loss_mask) != n:
            raise ValueError(f"generate plug-in returned {n} ids, {len(self.logprobs)} logprobs and a loss mask of "
                             f"{len(self.loss_mask)}: they must be aligned")
        if any(v not in (0, 1) for v in self.loss_mask):
            raise ValueError("generate plug-in returned a loss mask with values other than 0 and 1")


class RolloutClient(Protocol):
    """What a generate plug-in may call."""

    async def generate(self, input_ids: Sequence[int], sampling: SamplingParams) -> Generation: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


GenerateFn = Callable[[RolloutClient, PromptSpec, SamplingParams], Awaitable[GenerateResult]]


def load_generate_fn(path: str, field: str = "rollout.generate_fn") -> GenerateFn:
    """Import and check a generate plug-in (an `async def` taking client, prompt and sampling)."""
    return load_async_fn(path, field, positional=3)


class Interrupted(Exception):
    """The manager stopped (a weight update) while a generate plug-in waited for an engine."""


class SlotClient:
    """The `RolloutClient` a generate plug-in gets for one slot of a `RolloutManager` (`manager`): requests run
    with the manager's fault handling (retries on other engines) and stop when it stops."""

    def __init__(self, manager: Any, spec: PromptSpec, slot: Slot, stats: RolloutStats) -> None:
        self._manager, self._spec, self._slot, self._stats = manager, spec, slot, stats
        self.versions: list[str] = []
        self.engines: list[str] = []

    def encode(self, text: str) -> list[int]:
        assert self._manager.encode is not None
        return self._manager.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        assert self._manager.decode is not None
        return self._manager.decode(list(ids))

    async def generate(self, input_ids: Sequence[int], sampling: SamplingParams) -> Generation:
        manager = self._manager
        scratch = Slot(self._slot.sample_index, sampling.seed)
        spec = replace(self._spec, prompt_ids=tuple(input_ids))
        while not scratch.done:
            remaining = sampling.max_new_tokens - len(scratch.response_ids)
            if remaining <= 0:
                scratch.finish_reason = "length"
                break
            if manager.state is not ManagerState.RUNNING:
                raise Interrupted
            lease = await manager.fleet.acquire(frozenset(scratch.failed_on), timeout_s=manager.cfg.request_timeout_s)
            self._slot.in_request = True
            try:
                if manager.state is not ManagerState.RUNNING:
                    await manager.fleet.release(lease, ok=False)
                    raise Interrupted
                await manager._request(spec, sampling, scratch, lease, remaining, self._stats)
            finally:
                self._slot.in_request = False
        self.versions += scratch.versions
        self.engines += scratch.engines
        return Generation(tuple(scratch.response_ids), tuple(scratch.logprobs), scratch.finish_reason,
                          joined(scratch.versions), joined(scratch.engines))
