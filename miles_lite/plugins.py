"""Plug-ins named by import path in the configuration: ``"package.module:attribute"``.

A plug-in is imported once, at start-up, and its signature checked against what the call site will
pass, so a typo or a wrong signature fails before any work with the field's name, not minutes later
inside a rollout.
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
