"""The reward set a run scores with: a named set (or none), weight overrides, plug-ins (functions, factories
called with their arguments: `rewards.specs`), plug-ins by data source, a remote reward model."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping
from typing import Any

from miles_lite.plugins import PluginError, check_signature, load_plugin
from miles_lite.rewards.agent import AGENT_REWARD, agent_reward
from miles_lite.rewards.batch import MATH_KEYWORDS, reward_style
from miles_lite.rewards.records import ExactMatch
from miles_lite.rewards.registry import RegisteredReward, RewardSet, get_reward_set
from miles_lite.rewards.remote import RemoteReward, RemoteRewardSpec
from miles_lite.rewards.specs import PluginSpec, custom_specs, parse_call

# Keywords every math-style batch reward function is called with (besides the completions).
REWARD_KEYWORDS = MATH_KEYWORDS
# `rewards.set=none`: no named set, only plug-ins and the remote reward model.
NO_SET = "none"


def _accepts_kwargs(fn: Any) -> bool | None:
    """Whether `fn` takes **kwargs (None: no signature to read)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def _factory_hint(fn: Any, path: str) -> str:
    """How to call `fn` as a factory, with its own parameters as placeholders."""
    try:
        params = [p for p in inspect.signature(fn).parameters.values()
                  if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    except (TypeError, ValueError):
        params = []
    required = [p.name for p in params if p.default is p.empty]
    call = ", ".join(f"{name}=..." for name in required)
    block = ", ".join(f"{name}: ..." for name in required)
    returns = inspect.signature(fn).return_annotation if params else None
    factory = "it returns a Callable, so it is a factory" if "Callable" in str(returns) else "if it is a factory"
    return (f"; {factory}: call it with its arguments, rewards.custom='{path}({call})', or a block "
            f"{{fn: {path}, kwargs: {{{block}}}}}")


def _load_spec(spec: PluginSpec) -> Any:
    """The object `spec` names: the plug-in itself, or what its factory returned."""
    obj = load_plugin(spec.path, spec.field)
    if not spec.call:
        return obj
    if not callable(obj):
        raise PluginError(f"{spec.field}={spec.shown!r}: {spec.path!r} is not callable, so it cannot be called")
    try:
        made = obj(*spec.args, **spec.kwargs)
    except Exception as exc:  # the factory's own refusal, named
        raise PluginError(f"{spec.field}={spec.shown!r}: the factory raised {type(exc).__name__}: {exc}") from exc
    if not callable(made):
        raise PluginError(f"{spec.field}={spec.shown!r}: the factory returned {type(made).__name__}, not a reward "
                          "function")
    return made


def load_reward_fn(path: str | PluginSpec, field: str) -> tuple[str, RegisteredReward]:
    """A plug-in reward function: the math convention `fn(completions, *, answers, questions, steps)` when it
    names those three, else TRL's `fn(prompts=, completions=, completion_ids=, **columns)` with `**kwargs`
    (sync or async). `path` may call a factory (`rewards.specs`). Its name (the entry's `name`, else the
    function's `__name__`), and its best raw value: the entry's `max_value`, else an attribute `max_value`
    on the function, else None (judged over the group: `rewards.success`).

    Raises:
        PluginError: naming ``field``, for a bad path or a function of neither convention.
    """
    spec = parse_call(path, field) if isinstance(path, str) else path
    return _reward_of(spec, _load_spec(spec))


def _reward_of(spec: PluginSpec, fn: Any) -> tuple[str, RegisteredReward]:
    field = spec.field
    if not callable(fn):
        raise PluginError(f"{field}: {fn!r} is not callable")
    style = reward_style(fn)
    if style == "math":
        check_signature(fn, field, positional=1, keywords=REWARD_KEYWORDS)
    elif _accepts_kwargs(fn) is False:
        hint = "" if spec.call else _factory_hint(fn, spec.path)
        raise PluginError(f"{field}={spec.shown!r}: a reward function is called with prompts=, completions=, "
                          "completion_ids=, every record column and trainer_state=, log_metric=, log_extra= by name, "
                          "so it must accept **kwargs (or name answers, questions and steps: the math convention)"
                          f"{hint}")
    name = spec.name or getattr(fn, "__name__", "") or type(fn).__name__ or spec.path.rpartition(":")[2]
    declared = spec.max_value if spec.max_value is not None else getattr(fn, "max_value", None)
    if declared is not None:
        try:
            declared = float(declared)
        except (TypeError, ValueError):
            raise PluginError(f"{field}: the function's max_value {declared!r} is not a number") from None
    return name, RegisteredReward(fn, declared, style)


def load_custom_reward(path: str | PluginSpec, field: str = "rewards.custom"
                       ) -> RewardSet | tuple[str, RegisteredReward]:
    """Import the plug-in at ``path``: a :class:`RewardSet` (used as the whole set), or a reward function
    (see `load_reward_fn`, added under its name).

    Raises:
        PluginError: naming ``field``, for a bad path or an object of neither kind.
    """
    spec = parse_call(path, field) if isinstance(path, str) else path
    obj = _load_spec(spec)
    if isinstance(obj, RewardSet):
        return obj
    return _reward_of(spec, obj)


def build_reward_set(set_name: str, weights: Mapping[str, float], custom: Any = None,
                     remote: RemoteRewardSpec | None = None, by_source: Mapping[str, str] | None = None,
                     answer_pattern: str | None = None, agent: bool = False) -> RewardSet:
    """The set named ``set_name`` (nothing for ``none``; or a plug-in set of ``custom``), plus the plug-in
    reward functions of ``custom`` (one entry or a list: `rewards.specs`), one function per data source
    (``by_source``: scored under the source's name, None for records of other sources) and the remote reward
    model, then ``weights`` applied on top (they may name any of them). ``answer_pattern`` configures the
    `exact_match` reward. ``agent`` (`rollout.agent` is set) adds the reward `agent`: what each sample's agent
    returned as `reward`.

    Raises:
        PluginError / ValueError: naming the field at fault.
    """
    weights_of: dict[str, float] = {}
    functions: dict[str, RegisteredReward] = {}
    name = set_name
    if set_name != NO_SET:
        base = get_reward_set(set_name)
        weights_of, functions = dict(base.weights), dict(base.functions)
    loaded = [(spec, load_custom_reward(spec, spec.field)) for spec in custom_specs(custom)]
    sets = [(spec, obj) for spec, obj in loaded if isinstance(obj, RewardSet)]
    if len(sets) > 1:
        raise PluginError(f"{sets[1][0].field}: only one RewardSet may replace rewards.set (also "
                          f"{sets[0][0].field}={sets[0][0].shown!r})")
    for _, reward_set in sets:
        name, weights_of, functions = reward_set.name, dict(reward_set.weights), dict(reward_set.functions)
    for spec, obj in loaded:
        if not isinstance(obj, RewardSet):
            fix = "give the entry its own name (a block with name: ...)" if spec.call else "rename the function"
            _add(weights_of, functions, *obj, 1.0, f"{spec.field}={spec.shown!r}", fix)
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
