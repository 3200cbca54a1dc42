"""The reward set a run scores with: a named set (or none), weight overrides, a plug-in, plug-ins by data
source, a remote reward model."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping

from miles_lite.plugins import PluginError, check_signature, load_plugin
from miles_lite.rewards.agent import AGENT_REWARD, agent_reward
from miles_lite.rewards.batch import MATH_KEYWORDS, reward_style
from miles_lite.rewards.records import ExactMatch
from miles_lite.rewards.registry import RegisteredReward, RewardSet, get_reward_set
from miles_lite.rewards.remote import RemoteReward, RemoteRewardSpec

# Keywords every math-style batch reward function is called with (besides the completions).
REWARD_KEYWORDS = MATH_KEYWORDS
# `rewards.set=none`: no named set, only plug-ins and the remote reward model.
NO_SET = "none"


def load_reward_fn(path: str, field: str) -> tuple[str, RegisteredReward]:
    """A plug-in reward function: the math convention `fn(completions, *, answers, questions, steps)` when it
    names those three, else TRL's `fn(prompts=, completions=, completion_ids=, **columns)` with `**kwargs`
    (sync or async). Its name, and an attribute `max_value` on it, its largest raw value (default 1.0).

    Raises:
        PluginError: naming ``field``, for a bad path or a function of neither convention.
    """
    fn = load_plugin(path, field)
    if not callable(fn):
        raise PluginError(f"{field}: {fn!r} is not callable")
    style = reward_style(fn)
    if style == "math":
        check_signature(fn, field, positional=1, keywords=REWARD_KEYWORDS)
    else:
        try:
            params = inspect.signature(fn).parameters.values()
        except (TypeError, ValueError):
            params = ()
        if params and not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
            raise PluginError(f"{field}={path!r}: a reward function is called with prompts=, completions=, "
                              "completion_ids= and every record column by name, so it must accept **kwargs "
                              "(or name answers, questions and steps: the math convention)")
    name = getattr(fn, "__name__", "") or path.rpartition(":")[2]
    return name, RegisteredReward(fn, float(getattr(fn, "max_value", 1.0)), style)


def load_custom_reward(path: str, field: str = "rewards.custom") -> RewardSet | tuple[str, RegisteredReward]:
    """Import the plug-in at ``path``: a :class:`RewardSet` (used as the whole set), or a reward function
    (see `load_reward_fn`, added under its name).

    Raises:
        PluginError: naming ``field``, for a bad path or an object of neither kind.
    """
    obj = load_plugin(path, field)
    if isinstance(obj, RewardSet):
        return obj
    return load_reward_fn(path, field)


def build_reward_set(set_name: str, weights: Mapping[str, float], custom: str | None = None,
                     remote: RemoteRewardSpec | None = None, by_source: Mapping[str, str] | None = None,
                     answer_pattern: str | None = None, agent: bool = False) -> RewardSet:
    """The set named ``set_name`` (nothing for ``none``; or the plug-in set ``custom``), plus the plug-in
    reward function ``custom``, one function per data source (``by_source``: scored under the source's name,
    None for records of other sources) and the remote reward model, then ``weights`` applied on top (they
    may name any of them). ``answer_pattern`` configures the `exact_match` reward. ``agent`` (`rollout.agent` is
    set) adds the reward `agent`: what each sample's agent returned as `reward`.

    Raises:
        PluginError / ValueError: naming the field at fault.
    """
    weights_of: dict[str, float] = {}
    functions: dict[str, RegisteredReward] = {}
    name = set_name
    if set_name != NO_SET:
        base = get_reward_set(set_name)
        weights_of, functions = dict(base.weights), dict(base.functions)
    if custom:
        loaded = load_custom_reward(custom)
        if isinstance(loaded, RewardSet):
            name, weights_of, functions = loaded.name, dict(loaded.weights), dict(loaded.functions)
        else:
            _add(weights_of, functions, *loaded, 1.0, f"rewards.custom={custom!r}", "rename the function")
    for source, path in (by_source or {}).items():
        fn_name, reward = load_reward_fn(path, f"rewards.by_source.{source}")
        reward = dataclasses.replace(reward, source=source)
        _add(weights_of, functions, source, reward, 1.0, f"rewards.by_source.{source}", "rename the source")
    if remote is not None:
        if not remote.url.startswith(("http://", "https://")):
            raise ValueError(f"rewards.remote.url={remote.url!r} must be an http(s) URL")
        _add(weights_of, functions, remote.name, RegisteredReward(RemoteReward(remote), remote.max_score, "batch"),
             remote.weight, f"rewards.remote.name={remote.name!r}", "choose another name")
    if agent:
        _add(weights_of, functions, AGENT_REWARD, RegisteredReward(agent_reward, style="batch"), 1.0,
             "rollout.agent", "rename the other reward")
    if not weights_of:
        raise ValueError("rewards.set=none leaves no reward: add rewards.custom, rewards.by_source.<source>, "
                         "rewards.remote.url or rollout.agent (its returned reward), or pick a named set")
    try:
        reward_set = RewardSet(name, weights_of, functions).with_weights(dict(weights))
    except ValueError as exc:
        raise ValueError(f"rewards.weights: {exc}") from None
    if answer_pattern is not None:
        if "exact_match" not in reward_set.weights:
            raise ValueError(f"rewards.answer_pattern={answer_pattern!r} configures the exact_match reward, which the "
                             "reward set lacks: use rewards.set=exact_match or add +rewards.weights.exact_match=1.0")
        exact = RegisteredReward(ExactMatch(answer_pattern), style="batch")
        reward_set = RewardSet(reward_set.name, reward_set.weights, {**reward_set.functions, "exact_match": exact})
    return reward_set


def _add(weights: dict[str, float], functions: dict[str, RegisteredReward], name: str, reward: RegisteredReward,
         weight: float, field: str, fix: str) -> None:
    if name in weights or name == "total":
        raise PluginError(f"{field}: the reward set already has a reward named {name!r}; {fix}")
    weights[name] = weight
    functions[name] = reward
