"""Rope-scaled tiny models (Llama 3.1-style llama3, YaRN) through the Megatron trainer, run in a spawned rank."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from miles_lite.config.views import ActorConfig

# Pretraining lengths far below the test sequences, so every scaled frequency band is exercised.
LLAMA31_STYLE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                 "original_max_position_embeddings": 32}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 8.0,
        "beta_slow": 0.5}
CASES: dict[str, tuple[str, dict[str, Any]]] = {"llama3": ("llama", LLAMA31_STYLE), "yarn": ("qwen3", YARN)}


def scenario_rope(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Per case: Megatron logits and log-probs against transformers', and against the unscaled model's."""
    import torch.distributed as dist
    from trainer_harness import make_test_checkpoint
    from trainer_scenarios import _max_diff, hf_logits, hf_logprobs, make_batch, make_config, megatron_logits

    from miles_lite.trainer.actor import TrainerActor

    out: dict[str, Any] = {}
    for name, (arch, scaling) in CASES.items():
        path, plain = Path(root) / name, Path(root) / f"{name}_plain"
        if rank == 0:
            make_test_checkpoint(arch, path, rope_theta=500000.0 if name == "llama3" else 10000.0,
                                 rope_scaling=scaling)
            make_test_checkpoint(arch, plain, rope_theta=500000.0 if name == "llama3" else 10000.0)
        dist.barrier()
        batch = make_batch(500)
        seq = [t % 500 for t in range(7, 7 + 96 * 5, 5)]  # 96 tokens: 3x to 6x the pretraining length
        actor = TrainerActor(ActorConfig.of(make_config(str(path), tp=world_size)), rank, world_size)
        logits = megatron_logits(actor, seq)
        res = {"rope_type": actor.policy.spec.rope.rope_type,
               "logits_vs_hf": float((logits - hf_logits(str(path), seq)).abs().max()),
               "logits_vs_unscaled_hf": float((logits - hf_logits(str(plain), seq)).abs().max()),
               "logprobs_vs_hf": _max_diff(actor.compute_logprobs(batch), hf_logprobs(str(path), batch))}
        exported = actor.export_hf_state_dict()
        actor.close()
        if rank == 0:
            from miles_lite.trainer.hf_convert import read_hf_state

            original = read_hf_state(path)
            res["roundtrip_bit_exact"] = set(exported) == set(original) and all(
                torch.equal(exported[k], original[k]) for k in original)
        out[name] = res
    return out
