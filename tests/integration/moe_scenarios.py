"""Qwen3-MoE through the Megatron trainer in spawned ranks: conversion, expert parallelism, train steps."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def _checkpoint(rank: int, root: str) -> str:
    import torch.distributed as dist
    from trainer_harness import make_test_checkpoint

    path = Path(root) / "qwen3_moe"
    if rank == 0:
        make_test_checkpoint("qwen3_moe", path)
    dist.barrier()
    return str(path)


def scenario_moe_single(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """One rank: conversion against transformers, HF round trip, a train step."""
    from trainer_scenarios import conversion_checks, make_batch, make_config, train_checks

    from miles_lite.trainer.actor import TrainerActor

    path = _checkpoint(rank, root)
    batch = make_batch(500)
    actor = TrainerActor(make_config(path), rank, world_size)
    out = {"conversion": conversion_checks(actor, path, batch), "train": train_checks(actor, batch)}
    actor.close()
    return out


def scenario_moe_two_ranks(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Two ranks: EP=2 with DP=2 and with TP=2: conversion, where each expert lives, and a train step."""
    from trainer_scenarios import conversion_checks, make_batch, make_config, train_checks

    from miles_lite.trainer.actor import TrainerActor

    path = _checkpoint(rank, root)
    batch = make_batch(500)
    out: dict[str, Any] = {}
    for key, kw in {"ep2_dp2": dict(dp=2, ep=2), "ep2_tp2": dict(tp=2, ep=2)}.items():
        actor = TrainerActor(make_config(path, **kw), rank, world_size)
        res = conversion_checks(actor, path, batch)
        res["experts"] = sorted({lay.expert for _, _, lay in actor.named_shards() if lay.expert is not None})
        res["ep_rank"] = actor.par.ep_rank
        res["train"] = train_checks(actor, batch)
        out[key] = res
        actor.close()
    return out


def hf_state_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
