"""The flags engines are launched with: SGLang's decode CUDA graphs sized to the batch each engine decodes,
through the view every launch path reads (`EngineFleetConfig`), and the user's own setting kept."""

from __future__ import annotations

import pytest

from miles_lite.config import load_config
from miles_lite.config.engine_launch import decode_graph_batch, engine_batch, launch_rollout
from miles_lite.config.views import EngineFleetConfig
from miles_lite.engines.sglang.command import for_installed_sglang


def _cfg(*overrides: str):
    return load_config(["rollout=sglang", *overrides])


def test_recipe_shape_gets_graphs_for_the_whole_step() -> None:
    cfg = _cfg("rollout.prompts_per_step=64", "rollout.group_size=8", "rollout.engines=1")
    assert engine_batch(cfg.rollout) == 512
    assert EngineFleetConfig.of(cfg).rollout.sglang_args["cuda_graph_max_bs"] == 512
    assert "cuda_graph_max_bs" not in cfg.rollout.sglang_args  # the user's mapping is left as it is


@pytest.mark.parametrize(("overrides", "expected"), [
    (("rollout.prompts_per_step=64", "rollout.group_size=8", "rollout.engines=4"), 128),
    (("rollout.prompts_per_step=5", "rollout.group_size=3", "rollout.engines=1"), 16),  # 15 -> a multiple of 8
    (("rollout.prompts_per_step=1", "rollout.group_size=2", "rollout.engines=2"), 8),
    (("rollout.prompts_per_step=512", "rollout.group_size=16", "rollout.engines=1"), 1024),
    (("rollout.prompts_per_step=64", "rollout.group_size=8", "rollout.engines=1",
      "rollout.max_inflight_per_engine=200"), 200),
])
def test_graph_batch_follows_the_engines_batch(overrides: tuple[str, ...], expected: int) -> None:
    assert decode_graph_batch(_cfg(*overrides).rollout) == expected


@pytest.mark.parametrize("given", ["+rollout.sglang_args.cuda_graph_max_bs=64",
                                   "+rollout.sglang_args.cuda-graph-max-bs-decode=64",
                                   "+rollout.sglang_args.disable_cuda_graph=true"])
def test_the_users_graph_settings_win(given: str) -> None:
    args = launch_rollout(_cfg("rollout.prompts_per_step=64", given)).sglang_args
    assert "cuda_graph_max_bs" not in args or args["cuda_graph_max_bs"] == 64


def test_reference_engines_get_no_sglang_flags() -> None:
    cfg = load_config(["rollout.prompts_per_step=64"])
    assert launch_rollout(cfg).sglang_args == cfg.rollout.sglang_args


@pytest.mark.parametrize(("known", "spelt"), [
    (frozenset({"--cuda-graph-max-bs"}), "cuda_graph_max_bs"),  # SGLang 0.5.10
    (frozenset({"--cuda-graph-max-bs", "--cuda-graph-max-bs-decode"}), "cuda_graph_max_bs_decode"),  # 0.5.17
])
def test_derived_flag_is_spelt_as_the_installed_sglang_knows_it(known: frozenset[str], spelt: str) -> None:
    args = launch_rollout(_cfg("rollout.prompts_per_step=64")).sglang_args
    assert for_installed_sglang(args, known)[spelt] == 512


def test_routing_replay_starts_sglang_returning_routed_experts() -> None:
    cfg = _cfg("model=tiny_qwen3_moe", "trainer.routing_replay=true")
    assert EngineFleetConfig.of(cfg).rollout.sglang_args["enable_return_routed_experts"] is True
    assert "enable_return_routed_experts" not in EngineFleetConfig.of(_cfg("model=tiny_qwen3_moe")).rollout.sglang_args
    # Reference engines answer routing requests without a flag.
    ref = load_config(["model=tiny_qwen3_moe", "trainer.routing_replay=true"])
    assert launch_rollout(ref).sglang_args == ref.rollout.sglang_args


def test_routing_replay_refuses_engines_told_not_to_return_routing() -> None:
    from miles_lite.config import ConfigError, validate

    with pytest.raises(ConfigError, match=r"rollout.sglang_args.enable_return_routed_experts=False: "
                                          r"trainer.routing_replay=true replays"):
        validate(_cfg("model=tiny_qwen3_moe", "trainer.routing_replay=true", "rollout.max_new_tokens=32",
                      "+rollout.sglang_args.enable-return-routed-experts=false"))
