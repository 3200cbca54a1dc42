"""Every weight_sync.transport x mode x rollout.backend combination is accepted or refused naming the fix,
and the weight-update group's backend follows where trainer and engines run."""

from __future__ import annotations

import copy
import itertools

import pytest
from test_experiment_gsm8k import _overrides, paths  # noqa: F401  (fixture)

from miles_lite.config import ConfigError, load_config, validate
from miles_lite.config.weight_sync_choice import collective_backend, weight_sync_problems

# What is refused, and the fix each refusal names.
REFUSED = {
    ("ipc", "reference"): "use weight_sync.transport=distributed or disk",
}


@pytest.fixture(scope="module")
def cpu_cfg():
    return load_config(["trainer.device=cpu"])


def test_every_combination_works_or_is_refused_naming_the_fix(cpu_cfg):
    for transport, mode, backend in itertools.product(("distributed", "ipc", "disk"), ("shard", "full"),
                                                      ("reference", "sglang")):
        cfg = copy.deepcopy(cpu_cfg)
        cfg.weight_sync.transport, cfg.weight_sync.mode, cfg.rollout.backend = transport, mode, backend
        if transport == "ipc":
            cfg.cluster.placement = "colocated"
        problems = weight_sync_problems(cfg)
        fix = REFUSED.get((transport, backend))
        if fix is None:
            assert problems == [], (transport, mode, backend)
        else:
            assert len(problems) == 1 and fix in problems[0], (transport, mode, backend)
    cfg = copy.deepcopy(cpu_cfg)
    cfg.weight_sync.transport, cfg.rollout.backend = "ipc", "sglang"
    assert any("cluster.placement=colocated" in p for p in weight_sync_problems(cfg))


def test_cpu_runs_use_gloo_and_nccl_is_refused_there(cpu_cfg):
    assert collective_backend(cpu_cfg) == "gloo"
    with pytest.raises(ConfigError, match="weight_sync.backend=nccl: rollout.backend=reference engines run on CPU; "
                                          "use weight_sync.backend=gloo"):
        validate(load_config(["trainer.device=cpu", "weight_sync.backend=nccl"]))


def test_gsm8k_recipe_uses_nccl_on_two_gpus_and_gloo_on_one(paths):  # noqa: F811
    cfg = load_config(_overrides(paths))
    validate(cfg)
    # Trainer on GPU 0, the SGLang engine on GPU 1: the plugin path over NCCL.
    assert (cfg.weight_sync.transport, cfg.weight_sync.mode, collective_backend(cfg)) == ("distributed", "shard",
                                                                                           "nccl")
    one_gpu = copy.deepcopy(cfg)
    one_gpu.rollout.sglang_args["base_gpu_id"] = 0
    assert collective_backend(one_gpu) == "gloo"
    one_gpu.weight_sync.backend = "nccl"
    with pytest.raises(ConfigError, match=r"GPUs \[0\] hold a trainer rank and an engine.*weight_sync.backend=gloo"):
        validate(one_gpu)
    # Trainer TP=2 on GPUs 0-1: a TP=2 engine at GPU 1 shares one, at GPU 2 it does not.
    tp2 = copy.deepcopy(cfg)
    tp2.trainer.tp, tp2.rollout.engine_tp = 2, 2
    assert collective_backend(tp2) == "gloo"
    tp2.rollout.sglang_args["base_gpu_id"] = 2
    assert collective_backend(tp2) == "nccl"


def test_ipc_handles_needs_colocated_sglang_with_its_loader() -> None:
    from miles_lite.config.schema import IPC_HANDLES_LOADER, MilesConfig
    from miles_lite.config.weight_sync_choice import weight_sync_problems

    cfg = MilesConfig()
    cfg.weight_sync.transport = "ipc_handles"
    cfg.rollout.backend = "sglang"
    problems = " ".join(weight_sync_problems(cfg))
    assert "cluster.placement=colocated" in problems and IPC_HANDLES_LOADER in problems
    cfg.cluster.placement = "colocated"
    cfg.rollout.sglang_args = {"custom_weight_loader": [IPC_HANDLES_LOADER]}
    assert weight_sync_problems(cfg) == []
    cfg.rollout.backend = "reference"
    assert "hands CUDA IPC handles to SGLang" in " ".join(weight_sync_problems(cfg))


def test_sglang_expert_parallel_engines_take_only_pushes_sglang_places(cpu_cfg) -> None:
    # Pushes written into SGLang's parameters follow its tensor-parallel MoE layout (every expert on every rank).
    cases = [("distributed", "shard", True), ("ipc", "shard", True), ("distributed", "full", False),
             ("disk", "shard", False)]
    for transport, mode, refused in cases:
        cfg = copy.deepcopy(cpu_cfg)
        cfg.weight_sync.transport, cfg.weight_sync.mode, cfg.rollout.backend = transport, mode, "sglang"
        cfg.cluster.placement = "colocated" if transport == "ipc" else cfg.cluster.placement
        # Either spelling of the flag (both become --ep-size).
        key = "ep_size" if transport == "distributed" else "ep-size"
        cfg.rollout.sglang_args = {**cfg.rollout.sglang_args, key: 2}
        problems = [p for p in weight_sync_problems(cfg) if "ep_size" in p]
        assert bool(problems) == refused, (transport, mode)
        if refused:
            assert "rollout.sglang_args.ep_size=2" in problems[0] and "weight_sync.mode=full" in problems[0]
