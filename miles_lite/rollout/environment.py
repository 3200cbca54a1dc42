"""Tool environments for multi-turn rollouts, token in / token out.

A trajectory alternates model turns and environment replies inside one response: the model writes
until one of the environment's `stop` strings (its tool call), the environment answers with text,
the manager tokenises only that reply and appends its ids (never re-tokenising earlier turns), and the
model continues from there. Reply tokens carry no log-probability and are masked out of the loss.
The trajectory ends when a turn makes no tool call, after `rollout.max_turns` model turns, or when
the token budget (`rollout.max_new_tokens`, replies included) is spent.

An environment with a `reset(record)` method is asked once per trajectory, before its first reply, with
the record the prompt came from (its label and every column, e.g. a test suite in its metadata); what
`reset` returns (an object with `reply`) answers that trajectory's turns, so per-task state lives in
it; None: the environment itself answers.
"""

from __future__ import annotations

from typing import Any, Protocol

from miles_lite.data.calculator import Calculator
from miles_lite.plugins import BUILTIN_ENVIRONMENTS, environment_from_plugin


class ToolEnvironment(Protocol):
    """What the rollout manager needs of an environment."""

    # Strings that end a model turn calling the tool (added to the sampling stop strings).
    stop: tuple[str, ...]

    def reply(self, turn: str, question: str) -> str | None:
        """The environment's answer to the model turn `turn` (text), or None when the turn calls no tool
        (the trajectory ends). `question` is the prompt's question, for environments that need it."""
        ...


def start_trajectory(env: ToolEnvironment, record: Any) -> ToolEnvironment:
    """The environment that answers one trajectory: `env.reset(record)`'s result when `env` has `reset`
    and it returns one, else `env`."""
    reset = getattr(env, "reset", None)
    if reset is None:
        return env
    episode = reset(record)
    if episode is None:
        return env
    if not callable(getattr(episode, "reply", None)):
        raise TypeError(f"{type(env).__name__}.reset(record) returned {type(episode).__name__}, which has no "
                        "reply(turn, question) method; return the trajectory's environment or None")
    return episode


_BUILTIN = {"calculator": Calculator}
assert tuple(_BUILTIN) == BUILTIN_ENVIRONMENTS


def load_environment(name: str, field: str = "rollout.environment") -> ToolEnvironment:
    """A built-in environment by name, or a plug-in class/factory by import path ("pkg.module:Env")."""
    if name in _BUILTIN:
        return _BUILTIN[name]()
    return environment_from_plugin(name, field)
