"""Blocking access to the asyncio rollout stack for callers that are not coroutines.

The fleet (with its health-check task) and the manager live on one event loop run by a daemon
thread; `SyncRolloutManager` submits coroutines to it and blocks on their results, so a plain
training loop can call `generate_groups(...)` like a function.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import enum
import threading
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

from miles_lite.rollout.manager import PromptSource, RolloutManager, RolloutStats, Scorer
from miles_lite.rollout.prompt_spec import PromptLike
from miles_lite.rollout.starvation import StarvationRelay
from miles_lite.types import Group, SamplingParams

T = TypeVar("T")


class LoopState(enum.Enum):
    NEW = "new"
    RUNNING = "running"
    STOPPED = "stopped"


class EventLoopThread:
    """An asyncio event loop running in a daemon thread: new -> running -> stopped."""

    def __init__(self, name: str = "miles-lite-rollout") -> None:
        self.name = name
        self.state = LoopState.NEW
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._started = threading.Event()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self._started.set)
        self.loop.run_forever()

    def start(self, timeout_s: float = 10.0) -> EventLoopThread:
        """Start the thread and wait until its loop runs."""
        if self.state is not LoopState.NEW:
            raise RuntimeError(f"event loop thread {self.name} is {self.state.value}; start it once")
        self._thread.start()
        if not self._started.wait(timeout_s):
            raise RuntimeError(f"event loop thread {self.name} did not start within {timeout_s}s")
        self.state = LoopState.RUNNING
        return self

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float | None = None, *,
            relay: StarvationRelay | None = None) -> T:
        """Run `coro` on the loop and return its result (re-raising its exception).

        `relay`: while waiting, serve the fleet's requests to push the current weights to stale engines
        (for waits on a rollout; see `miles_lite.rollout.starvation`).
        """
        fut = self.submit(coro)
        return fut.result(timeout_s) if relay is None else relay.wait(fut, timeout_s)

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Start `coro` on the loop without waiting; its future (`result()` waits and re-raises)."""
        if self.state is not LoopState.RUNNING:
            coro.close()
            raise RuntimeError(f"event loop thread {self.name} is {self.state.value}, not running")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Cancel leftover tasks, stop the loop and join the thread (idempotent)."""
        if self.state is not LoopState.RUNNING:
            self.state = LoopState.STOPPED
            return

        async def _cancel_rest() -> None:
            current = asyncio.current_task()
            rest = [t for t in asyncio.all_tasks() if t is not current]
            for task in rest:
                task.cancel()
            await asyncio.gather(*rest, return_exceptions=True)

        self.run(_cancel_rest(), timeout_s)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout_s)
        self.loop.close()
        self.state = LoopState.STOPPED

    def __enter__(self) -> EventLoopThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class SyncRolloutManager:
    """Blocking facade over a `RolloutManager` whose fleet runs on `loop`."""

    def __init__(self, manager: RolloutManager, loop: EventLoopThread) -> None:
        self.manager = manager
        self.loop = loop
        # Set by the owner of the weights: blocking calls then serve its stale-engine pushes.
        self.relay: StarvationRelay | None = None

    def generate_groups(
        self,
        prompts: Sequence[PromptLike],
        group_size: int | None = None,
        sampling: SamplingParams | None = None,
        *,
        scorer: Scorer | None = None,
        more_prompts: PromptSource | None = None,
    ) -> list[Group]:
        """`RolloutManager.generate_groups`, blocking until the groups are complete."""
        return self.loop.run(self.manager.generate_groups(prompts, group_size, sampling, scorer=scorer,
                                                         more_prompts=more_prompts), relay=self.relay)

    def abort(self, timeout_s: float = 60.0) -> None:
        """`RolloutManager.abort`; callable from another thread while `generate_groups` blocks."""
        self.loop.run(self.manager.abort(timeout_s))

    @property
    def last_stats(self) -> RolloutStats:
        return self.manager.last_stats
