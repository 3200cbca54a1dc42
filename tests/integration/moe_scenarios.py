"""Qwen3-MoE through the Megatron trainer in spawned ranks: conversion, expert parallelism, train steps."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from miles_lite.config.views import ActorConfig


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
    actor = TrainerActor(ActorConfig.of(make_config(path)), rank, world_size)
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
        actor = TrainerActor(ActorConfig.of(make_config(path, **kw)), rank, world_size)
        res = conversion_checks(actor, path, batch)
        res["experts"] = sorted({lay.expert for _, _, lay in actor.named_shards() if lay.expert is not None})
        res["ep_rank"] = actor.par.ep_rank
        res["train"] = train_checks(actor, batch)
        out[key] = res
        actor.close()
    return out


def hf_state_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def hf_router_logits(path: str, seq: list[int]) -> list[torch.Tensor]:
    """transformers' router logits `[T, E]` of every MoE layer for one sequence."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        out = model(torch.tensor([seq]), output_router_logits=True)
    return [r.reshape(len(seq), -1) for r in out.router_logits]


def hf_forced_logprobs(path: str, seq: list[int], plen: int, forced: np.ndarray) -> list[float]:
    """transformers' response log-probs with the experts of positions plen .. plen + len(forced) - 1 forced
    to `forced` `[n, layers, k]` (gates: softmax over the forced experts' logits, as norm_topk_prob does)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    routers = [m for name, m in model.named_modules() if name.endswith("mlp.gate")]
    for layer, router in enumerate(routers):
        def forward(hidden: torch.Tensor, router: Any = router, layer: int = layer) -> Any:
            logits = torch.nn.functional.linear(hidden.reshape(-1, router.hidden_dim), router.weight)
            probs = torch.softmax(logits, dim=-1, dtype=torch.float)
            _, idx = torch.topk(probs, router.top_k, dim=-1)
            idx[plen:plen + len(forced)] = torch.as_tensor(forced[:, layer, :].astype(np.int64))
            gates = logits.gather(1, idx).softmax(dim=-1)
            return logits, gates, idx
        router.forward = forward
    with torch.no_grad():
        logits = model(torch.tensor([seq])).logits[0]
    lp = logits.log_softmax(-1)[plen - 1:-1].gather(-1, torch.tensor(seq[plen:])[:, None])[:, 0]
    return lp.tolist()


def scenario_replay(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Routing replay on one rank: the rollout's experts set to the ones transformers' router ranks last."""
    import dataclasses

    from trainer_scenarios import make_batch, make_config

    from miles_lite.trainer.actor import TrainerActor
    from miles_lite.trainer.routing import compact_ids

    path = _checkpoint(rank, root)
    batch = make_batch(500, n=4)
    worst, own = [], []
    for seq, plen in zip(batch.tokens, batch.prompt_lengths, strict=True):
        logits = hf_router_logits(path, seq)
        rows = range(plen, len(seq) - 1)  # generated tokens the engine fed back
        worst.append(compact_ids(np.stack([[lg[t].topk(2, largest=False).indices.numpy() for lg in logits]
                                           for t in rows]).reshape(-1, len(logits), 2), 8))
        own.append(compact_ids(np.stack([[lg[t].topk(2).indices.numpy() for lg in logits]
                                         for t in rows]).reshape(-1, len(logits), 2), 8))
    forced = dataclasses.replace(batch, routed_experts=worst)
    same = dataclasses.replace(batch, routed_experts=own)
    out: dict[str, Any] = {"dtype": str(worst[0].dtype)}
    actor = TrainerActor(ActorConfig.of(make_config(path, routing_replay=True)), rank, world_size)
    out["plain"] = actor.compute_logprobs(batch)
    out["forced"] = actor.compute_logprobs(forced)
    out["hf_forced"] = [hf_forced_logprobs(path, s, p, w) for s, p, w in
                        zip(batch.tokens, batch.prompt_lengths, worst, strict=True)]
    # The rollout routed as the trainer would (weights unchanged yet): agreement near 1.
    out["stats_same"] = actor.train_step(dataclasses.replace(same, rollout_logprobs=out["plain"]))
    actor.close()
    actor = TrainerActor(ActorConfig.of(make_config(path, routing_replay=True)), rank, world_size)
    router = dict(actor.policy.model.named_parameters())["decoder.layers.1.mlp.router.weight"].detach().clone()
    out["stats_forced"] = actor.train_step(dataclasses.replace(forced, rollout_logprobs=out["forced"]))
    out["router_moved"] = float((dict(actor.policy.model.named_parameters())[
        "decoder.layers.1.mlp.router.weight"].detach() - router).abs().max())
    actor.close()
    actor = TrainerActor(ActorConfig.of(make_config(path, routing_replay=False)), rank, world_size)
    out["off_forced"] = actor.compute_logprobs(forced)
    out["stats_off"] = actor.train_step(dataclasses.replace(forced, rollout_logprobs=out["off_forced"]))
    actor.close()
    return out


def scenario_moe_resume(rank: int, world_size: int, root: str, save: dict[str, int], resume: dict[str, int]
                        ) -> dict[str, Any]:
    """A layout `save` (trainer tp/dp/ep) trains a step and checkpoints; layout `resume` resumes it. Also the
    HF export of the trained model, loaded by transformers."""
    import torch.distributed as dist
    from trainer_scenarios import hf_logits, make_batch, make_config, megatron_logits

    from miles_lite.checkpoint import AsyncCheckpointer, CheckpointReader, newest_complete
    from miles_lite.checkpoint.trainer_state import checkpoint_payload, restore_actor
    from miles_lite.trainer.actor import TrainerActor
    from miles_lite.trainer.hf_convert import save_hf_checkpoint

    path = _checkpoint(rank, root)
    batch = make_batch(500)
    ckpt, export = Path(root) / "ckpt", Path(root) / "export"
    out: dict[str, Any] = {}
    actor = TrainerActor(ActorConfig.of(make_config(path, **save)), rank, world_size)
    actor.train_step(batch)
    saver = AsyncCheckpointer(str(ckpt))
    saver.save(1, checkpoint_payload(actor))
    saver.finalize()
    saver.close()
    out["saved_logprobs"] = actor.compute_logprobs(batch)
    out["saved_next"] = actor.train_step(batch)
    out["saved_after"] = actor.compute_logprobs(batch)
    # HF export of the trained model (every expert gathered over EP), loaded by transformers.
    seq = batch.tokens[0]
    logits = megatron_logits(actor, seq)
    exported = actor.export_hf_state_dict()
    if rank == 0:
        save_hf_checkpoint(exported, actor.hf_config, export)
        out["export_logits_diff"] = float((logits - hf_logits(str(export), seq)).abs().max())
    actor.close()
    dist.barrier()
    actor = TrainerActor(ActorConfig.of(make_config(path, **resume)), rank, world_size)
    restore_actor(actor, CheckpointReader(newest_complete(str(ckpt))))  # type: ignore[arg-type]
    out["resumed_logprobs"] = actor.compute_logprobs(batch)
    out["resumed_next"] = actor.train_step(batch)
    out["resumed_after"] = actor.compute_logprobs(batch)
    actor.close()
    return out
