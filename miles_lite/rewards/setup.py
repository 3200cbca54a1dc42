"""The reward set a run scores with: a named set, weight overrides, a plug-in, a remote reward model."""

from __future__ import annotations

from collections.abc import Mapping

from miles_lite.plugins import PluginError, check_signature, load_plugin
from miles_lite.rewards.registry import RegisteredReward, RewardSet, get_reward_set
from miles_lite.rewards.remote import RemoteReward, RemoteRewardSpec

# Keywords every batch reward function is called with (besides the completions).
REWARD_KEYWORDS = ("answers", "questions", "steps")


def load_custom_reward(path: str, field: str = "rewards.custom") -> RewardSet | tuple[str, RegisteredReward]:
    """Import the plug-in at ``path``: a :class:`RewardSet` (used as the whole set), or a batch reward
    function ``fn(completions, *, answers, questions, steps) -> list[float]`` (added under its name;
    an attribute ``max_value`` on it gives its largest raw value, default 1.0).

    Raises:
        PluginError: naming ``field``, for a bad path or an object of neither kind.
    """
    obj = load_plugin(path, field)
    if isinstance(obj, RewardSet):
        return obj
    fn = check_signature(obj, field, positional=1, keywords=REWARD_KEYWORDS)
    name = getattr(fn, "__name__", "") or path.rpartition(":")[2]
    return name, RegisteredReward(fn, float(getattr(fn, "max_value", 1.0)))


def build_reward_set(set_name: str, weights: Mapping[str, float], custom: str | None = None,
                     remote: RemoteRewardSpec | None = None) -> RewardSet:
    """The set named ``set_name`` (or the plug-in set ``custom``), plus the plug-in reward function
    ``custom`` and the remote reward model, then ``weights`` applied on top (they may name either).

    Raises:
        PluginError / ValueError: naming the field at fault.
    """
    reward_set = get_reward_set(set_name)
    if custom:
        loaded = load_custom_reward(custom)
        if isinstance(loaded, RewardSet):
            reward_set = loaded
        else:
            name, reward = loaded
            try:
                reward_set = reward_set.with_reward(name, reward, 1.0)
            except ValueError as exc:
                raise PluginError(f"rewards.custom={custom!r}: {exc}; rename the function") from None
    if remote is not None:
        if not remote.url.startswith(("http://", "https://")):
            raise ValueError(f"rewards.remote.url={remote.url!r} must be an http(s) URL")
        try:
            reward_set = reward_set.with_reward(remote.name, RegisteredReward(RemoteReward(remote), remote.max_score),
                                                remote.weight)
        except ValueError as exc:
            raise ValueError(f"rewards.remote.name={remote.name!r}: {exc}; choose another name") from None
    try:
        return reward_set.with_weights(dict(weights))
    except ValueError as exc:
        raise ValueError(f"rewards.weights: {exc}") from None
