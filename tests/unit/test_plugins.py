"""Plug-ins by import path: loading, signature checks, and the reward set built from them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

from miles_lite.config.compose import load_config  # noqa: E402
from miles_lite.config.validate import ConfigError, validate  # noqa: E402
from miles_lite.plugins import PluginError, check_signature, load_plugin  # noqa: E402
from miles_lite.rewards.registry import RewardSet, score  # noqa: E402
from miles_lite.rewards.remote import RemoteRewardSpec  # noqa: E402
from miles_lite.rewards.setup import build_reward_set  # noqa: E402


def test_load_plugin_resolves_dotted_attributes():
    assert load_plugin("os.path:join", "f") is __import__("os").path.join
    assert load_plugin("miles_plugins.rewards:brevity", "f").__name__ == "brevity"


@pytest.mark.parametrize(("path", "message"), [
    ("os.path.join", "not an import path; write it as 'package.module:function'"),
    ("no_such_pkg_xyz:fn", "cannot import module 'no_such_pkg_xyz'"),
    ("os.path:no_such_fn", "module 'os.path' has no attribute 'no_such_fn'"),
])
def test_bad_paths_name_the_field(path, message):
    with pytest.raises(PluginError, match="^rewards.custom=.*" + message.replace("(", r"\(").replace(")", r"\)")):
        load_plugin(path, "rewards.custom")


def test_signature_check_refuses_a_function_that_cannot_take_the_call():
    def two_positional(a, b): ...

    def rewardish(completions, *, answers, questions, steps): ...

    check_signature(rewardish, "f", 1, ("answers", "questions", "steps"))
    with pytest.raises(PluginError, match=r"^rewards.custom: .*two_positional.*cannot be called"):
        check_signature(two_positional, "rewards.custom", 1, ("answers", "questions", "steps"))
    with pytest.raises(PluginError, match="is not callable"):
        check_signature(3, "rewards.custom", 1)


def test_custom_reward_function_joins_the_set_and_scores():
    reward_set = build_reward_set("correctness_only", {"brevity": 0.5}, "miles_plugins.rewards:brevity")
    assert dict(reward_set.weights) == {"correctness_check": 1.0, "brevity": 0.5}
    rows = score(reward_set, ["<SOLUTION>3</SOLUTION>", "x" * 600], [3, 3], ["q", "q"], [(), ()])
    assert rows[0] == {"correctness_check": 1.0, "brevity": 1.0, "total": 1.5}
    assert rows[1] == {"correctness_check": 0.0, "brevity": 0.0, "total": 0.0}


def test_custom_reward_set_replaces_the_named_set(tmp_path, monkeypatch):
    (tmp_path / "my_set.py").write_text(
        "from miles_lite.rewards.registry import RewardSet\n"
        "SET = RewardSet('mine', {'format_check': 2.0})\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    reward_set = build_reward_set("worklog", {}, "my_set:SET")
    assert isinstance(reward_set, RewardSet) and dict(reward_set.weights) == {"format_check": 2.0}


def test_remote_reward_is_carried_by_the_set_with_its_weight_and_maximum():
    spec = RemoteRewardSpec("http://127.0.0.1:9/score", name="judge", weight=2.0, max_score=3.0)
    reward_set = build_reward_set("correctness_only", {}, None, spec)
    assert dict(reward_set.weights) == {"correctness_check": 1.0, "judge": 2.0}
    assert reward_set.max_total == 1.0 + 2.0 * 3.0
    with pytest.raises(ValueError, match="rewards.remote.url"):
        build_reward_set("worklog", {}, None, RemoteRewardSpec("ftp://x"))


def test_validation_reports_plugin_and_remote_problems_by_field():
    cfg = load_config(["rewards.custom=no_such_pkg_xyz:fn", "rewards.remote.url=localhost:1",
                   "rewards.remote.batch_size=0"])
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    text = "\n".join(err.value.problems)
    assert "rewards.remote.batch_size=0 must be a positive integer" in text
    cfg = load_config(["rewards.custom=no_such_pkg_xyz:fn"])
    with pytest.raises(ConfigError, match="rewards.custom='no_such_pkg_xyz:fn': cannot import"):
        validate(cfg)


def test_every_experiment_composes_and_validates():
    from miles_lite.config.compose import default_config_dir

    for path in sorted((default_config_dir() / "experiment").glob("*.yaml")):
        if path.stem.startswith("gsm8k"):
            continue  # needs a checkpoint and GSM8K files
        validate(load_config([f"experiment={path.stem}"]))


def test_prompts_over_max_prompt_tokens_are_refused_naming_the_field():
    from types import SimpleNamespace

    from miles_lite.data.encoding import PromptEncoder
    from miles_lite.data.gsm8k import MathProblem

    tokenizer = SimpleNamespace(eos_token_id=None, chat_template=None)
    encoder = PromptEncoder(tokenizer, max_prompt_tokens=5)
    encoder.encode = lambda text: list(range(len(text.split())))  # one token per word
    problem = MathProblem("one two three four five six seven", "#### 1", 1.0, ())
    with pytest.raises(ValueError, match="over data.max_prompt_tokens=5"):
        encoder.prompt_specs([(0, problem)])
    encoder.max_prompt_tokens = 1000
    assert len(encoder.prompt_specs([(0, problem)])[0].prompt_ids) > 5
