"""The agent plug-in (`rollout.agent=package.module:fn`): the user's own agent code drives a session of the
gateway through OpenAI chat completions, and the session becomes one sample.

    async def fn(base_url: str, api_key: str, record, sampling: dict) -> dict | None

`base_url` and `api_key` are the session's (pass them to `openai.AsyncOpenAI` as they are, or speak plain
HTTP), `record` the data record of the prompt (`data.records.Record`: `messages`, `prompt`, `label`,
`columns`, `source`; or a math problem), `sampling` the keyword arguments of the run's sampling for
`chat.completions.create` (the gateway applies them whether the agent passes them or not). A returned
`reward` is the sample's reward (reward `agent`); other fields reach the reward plug-ins as columns and the
rollout table. A plain `def` works too.

Each agent runs in a worker thread on an event loop of its own, at most `rollout.max_concurrent_agents` at
once: an agent that blocks (a slow tool called without `await`) delays only itself, never the rollout loop
that serves the gateway, the engines' health checks and every other agent. An agent past
`rollout.agent_timeout_s`, or one that raises, is stopped, counted and its sample dropped. The optional
`rollout.agent_abort` hook, ``fn(base_url, api_key, record, reason)``, is called after an agent was stopped
(reason ``timeout``, ``interrupted`` (a weight update: the agent runs again afterwards) or ``failed``) to end
work the agent started outside (a sandbox, a container).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from miles_lite.plugins import check_signature, load_plugin

logger = logging.getLogger(__name__)

AgentFn = Callable[[str, str, Any, dict], Any]


def load_agent(path: str, field: str = "rollout.agent", positional: int = 4) -> AgentFn:
    """Import and check an agent (or abort hook): a function of `positional` positional arguments."""
    return check_signature(load_plugin(path, field), field, positional=positional)


class AgentFailed(RuntimeError):
    """The agent raised or returned something other than a dict or None."""


class AgentTimedOut(TimeoutError):
    """The agent did not return within `rollout.agent_timeout_s`."""


class _Call:
    """One agent call on a worker thread: an `async def` on a new event loop there (cancellable from any thread),
    a plain function called as it is (it cannot be interrupted; its session is closed under it instead)."""

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self.fn, self.args = fn, args
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[Any] | None = None
        self._cancelled = False

    def run(self) -> Any:
        if not inspect.iscoroutinefunction(self.fn):
            return self.fn(*self.args)
        loop = asyncio.new_event_loop()
        try:
            with self._lock:
                if self._cancelled:
                    raise asyncio.CancelledError
                self._loop, self._task = loop, loop.create_task(self.fn(*self.args))
            return loop.run_until_complete(self._task)
        finally:
            with contextlib.suppress(Exception):
                loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    def cancel(self) -> None:
        with self._lock:
            self._cancelled = True
            if self._loop is not None and self._task is not None and not self._loop.is_closed():
                self._loop.call_soon_threadsafe(self._task.cancel)


class AgentRunner:
    """Runs agent calls in worker threads with a time limit; see the module docstring."""

    def __init__(self, fn: AgentFn, *, max_concurrent: int = 64, timeout_s: float = 600.0,
                 abort: AgentFn | None = None, abort_timeout_s: float = 60.0) -> None:
        self.fn, self.abort, self.timeout_s, self.abort_timeout_s = fn, abort, timeout_s, abort_timeout_s
        self.max_concurrent = max_concurrent
        self._threads = ThreadPoolExecutor(max_concurrent, thread_name_prefix="miles-agent")
        self._slots: asyncio.Semaphore | None = None

    async def run(self, base_url: str, api_key: str, record: Any, sampling: dict[str, Any]) -> dict[str, Any]:
        """The agent's result (a dict, {} for None). Raises AgentTimedOut or AgentFailed; cancelling the calling
        task cancels the agent (and calls the abort hook with reason ``interrupted``)."""
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.max_concurrent)
        args = (base_url, api_key, record, dict(sampling))
        async with self._slots:
            call = _Call(self.fn, args)
            future = asyncio.get_running_loop().run_in_executor(self._threads, call.run)
            try:
                result = await asyncio.wait_for(asyncio.shield(future), self.timeout_s)
            except asyncio.CancelledError:
                call.cancel()
                self._spawn_abort(args, "interrupted")
                raise
            except TimeoutError:
                call.cancel()
                await self._abort(args, "timeout")
                raise AgentTimedOut(f"the agent did not return within rollout.agent_timeout_s={self.timeout_s:g}s"
                                    ) from None
            except Exception as exc:
                await self._abort(args, "failed")
                raise AgentFailed(f"{type(exc).__name__}: {exc}") from exc
        if result is None:
            return {}
        if not isinstance(result, dict):
            await self._abort(args, "failed")
            raise AgentFailed(f"the agent returned {type(result).__name__}; return a dict (e.g. {{'reward': 1.0}}) "
                              "or None")
        return result

    async def _abort(self, args: tuple[Any, ...], reason: str) -> None:
        if self.abort is None:
            return
        call = _Call(self.abort, (*args[:3], reason))
        future = asyncio.get_running_loop().run_in_executor(None, call.run)
        try:
            await asyncio.wait_for(asyncio.shield(future), self.abort_timeout_s)
        except Exception as exc:  # the hook is best effort: the agent is already stopped
            call.cancel()
            logger.warning("rollout.agent_abort (%s) failed: %s: %s", reason, type(exc).__name__, exc)

    def _spawn_abort(self, args: tuple[Any, ...], reason: str) -> None:
        if self.abort is not None:
            asyncio.ensure_future(self._abort(args, reason))

    def close(self) -> None:
        """Stop taking agents; running ones finish on their threads (their sessions are closed)."""
        self._threads.shutdown(wait=False, cancel_futures=True)
