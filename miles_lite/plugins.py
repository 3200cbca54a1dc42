"""Plug-ins named by import path in the configuration: ``"package.module:attribute"``.

A plug-in is imported once, at start-up, and its signature checked against what the call site will
pass, so a typo or a wrong signature fails before any work with the field's name, not minutes later
inside a rollout. Blocking plug-in calls run in a `PluginPool` (worker threads or processes, a time limit per
call), so an event loop that awaits them never stalls behind one.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Sequence
from typing import Any


class PluginError(ValueError):
    """A plug-in path that cannot be imported, or an object of the wrong shape; names the field."""


class PluginFailed(RuntimeError):
    """A plug-in failed while the run used it: it raised, or returned what its caller cannot use.

    `plugin` names it as the user knows it (``reward 'brevity'``, ``rollout.group_filter=pkg:fn``);
    the original exception is `__cause__`. A run ends on it without saving anything half-done.
    """

    def __init__(self, plugin: str, error: BaseException) -> None:
        detail = str(error) or type(error).__name__
        super().__init__(f"{plugin} failed: {type(error).__name__}: {detail}")
        self.plugin = plugin
        self.error = error
        # Where in the run it failed ("at step 3/5"), set by the loop that was running it.
        self.where: str | None = None


def load_plugin(path: str, field: str) -> Any:
    """Import ``path`` (``"pkg.module:attr"``, ``attr`` may be dotted) and return the object.

    Raises:
        PluginError: malformed path, module not importable, attribute missing.
    """
    module_name, sep, attr = str(path).partition(":")
    if not sep or not module_name or not attr:
        raise PluginError(f"{field}={path!r} is not an import path; write it as 'package.module:function'")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as exc:  # any import-time failure of user code is reported the same way
        raise PluginError(f"{field}={path!r}: cannot import module {module_name!r} ({type(exc).__name__}: "
                          f"{exc}); make it importable (installed, or on PYTHONPATH)") from exc
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise PluginError(f"{field}={path!r}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def check_signature(fn: Any, field: str, positional: int, keywords: Sequence[str] = ()) -> Callable[..., Any]:
    """Check that ``fn`` can be called with ``positional`` positional arguments and these keywords.

    Raises:
        PluginError: ``fn`` is not callable or its parameters do not accept that call.
    """
    if not callable(fn):
        raise PluginError(f"{field}: {fn!r} is not callable")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins without a signature: nothing to check
        return fn
    args = [object()] * positional
    kwargs = {name: object() for name in keywords}
    try:
        signature.bind(*args, **kwargs)
    except TypeError as exc:
        wanted = ", ".join([f"<{positional} positional>", *[f"{k}=" for k in keywords]])
        raise PluginError(f"{field}: {getattr(fn, '__qualname__', fn)}{signature} cannot be called as "
                          f"fn({wanted}): {exc}") from None
    return fn


def load_async_fn(path: str, field: str, positional: int) -> Callable[..., Any]:
    """Import an `async def` plug-in callable with ``positional`` positional arguments.

    Raises:
        PluginError: as :func:`load_plugin` and :func:`check_signature`, or the function is not async.
    """
    fn = check_signature(load_plugin(path, field), field, positional=positional)
    if not inspect.iscoroutinefunction(fn):
        raise PluginError(f"{field}={path!r} must be an `async def` function (it awaits engine calls)")
    return fn


# Tool environments built into the rollout client, by name (their classes: miles_lite.rollout.environment).
BUILTIN_ENVIRONMENTS = ("calculator",)


def environment_from_plugin(path: str, field: str) -> Any:
    """The environment object a plug-in path names: a class or factory is called once, an object with
    `reply` is used as it is.

    Raises:
        PluginError: neither a built-in name nor an import path, or the object lacks `reply` / `stop`.
    """
    if ":" not in path:
        raise PluginError(f"{field}={path!r} is neither a built-in environment ({', '.join(BUILTIN_ENVIRONMENTS)}) "
                          "nor an import path 'package.module:Environment'")
    factory = load_plugin(path, field)
    env = factory() if isinstance(factory, type) or not hasattr(factory, "reply") else factory
    stop = getattr(env, "stop", None)
    if not callable(getattr(env, "reply", None)) or not isinstance(stop, tuple | list) or not stop:
        raise PluginError(f"{field}={path!r}: an environment needs a `reply(turn, question)` method and a non-empty "
                          "`stop` tuple of strings")
    return env


def load_sync_fn(path: str, field: str, positional: int) -> Callable[..., Any]:
    """Import a plain (not async) plug-in callable with ``positional`` positional arguments."""
    fn = check_signature(load_plugin(path, field), field, positional=positional)
    if inspect.iscoroutinefunction(fn):
        raise PluginError(f"{field}={path!r} must be a plain function, not `async def`")
    return fn


# ------------------------------------------------------------------ running plug-in calls off the event loop

PLUGIN_POOLS = ("threads", "processes")


class PluginTimeout(TimeoutError):
    """A plug-in call that did not return within its time limit (the call is abandoned, see `PluginPool`)."""

    def __init__(self, what: str, timeout_s: float) -> None:
        super().__init__(f"{what} did not return within {timeout_s:g}s")
        self.what = what
        self.timeout_s = timeout_s


class PluginPool:
    """Runs blocking plug-in calls (tool environments' replies and resets, reward functions) in a pool of worker
    threads, or of processes (`kind="processes"`: the function and its arguments must pickle, and state a call
    changes stays in the worker), each call bounded by `timeout_s`. An event loop awaits `acall` and keeps
    serving everything else meanwhile; other threads block on `call`.

    A call past its limit raises `PluginTimeout`; Python cannot stop a thread, so a timed-out thread call runs
    on unobserved until it returns (its worker is busy meanwhile), while a timed-out process call gets its
    worker process terminated and the pool renewed.
    """

    def __init__(self, workers: int = 8, kind: str = "threads", timeout_s: float | None = 60.0) -> None:
        if kind not in PLUGIN_POOLS:
            raise ValueError(f"plug-in pool kind {kind!r} is not one of {PLUGIN_POOLS}")
        if workers < 1:
            raise ValueError(f"plug-in pool workers must be >= 1, got {workers}")
        if timeout_s is not None and timeout_s <= 0:
            raise ValueError(f"plug-in call timeout must be > 0 seconds, got {timeout_s}")
        self.workers, self.kind, self.timeout_s = workers, kind, timeout_s
        self._executor: Any = None

    def _pool(self) -> Any:
        from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor

        if self._executor is None:
            if self.kind == "processes":
                import multiprocessing

                # spawn: a forked copy of a process running threads (the rollout loop, Ray) can deadlock.
                self._executor = ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("spawn"))
            else:
                self._executor = ThreadPoolExecutor(self.workers, thread_name_prefix="miles-plugin")
        return self._executor

    def _timed_out(self, what: str, limit: float) -> PluginTimeout:
        if self.kind == "processes" and self._executor is not None:
            stuck, self._executor = self._executor, None
            for process in list(getattr(stuck, "_processes", {}).values()):
                process.terminate()
            stuck.shutdown(wait=False, cancel_futures=True)
        return PluginTimeout(what, limit)

    def call(self, what: str, fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None,
             timeout_s: float | None = None) -> Any:
        """`fn(*args, **kwargs)` in the pool, blocking this thread (never an event loop's) until it returns, at most
        `timeout_s` (default: the pool's) seconds."""
        from concurrent.futures import TimeoutError as FutureTimeout
        from functools import partial

        limit = timeout_s or self.timeout_s
        future = self._pool().submit(partial(fn, *args, **(kwargs or {})))
        try:
            return future.result(limit)
        except FutureTimeout:
            raise self._timed_out(what, limit or 0.0) from None

    async def acall(self, what: str, fn: Callable[..., Any], args: Sequence[Any] = (),
                    kwargs: dict[str, Any] | None = None, timeout_s: float | None = None) -> Any:
        """`fn(*args, **kwargs)` in the pool, awaited: the event loop runs on while it works."""
        import asyncio
        from functools import partial

        limit = timeout_s or self.timeout_s
        future = asyncio.get_running_loop().run_in_executor(self._pool(), partial(fn, *args, **(kwargs or {})))
        try:
            return await asyncio.wait_for(future, limit)
        except TimeoutError:
            raise self._timed_out(what, limit or 0.0) from None

    def close(self) -> None:
        """Stop the workers (idempotent); running thread calls finish on their own, processes are ended."""
        executor, self._executor = self._executor, None
        if executor is not None:
            if self.kind == "processes":
                for process in list(getattr(executor, "_processes", {}).values()):
                    process.terminate()
            executor.shutdown(wait=False, cancel_futures=True)
