"""Run trainer scenarios on real gloo process groups: one spawned process per rank, results via files."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from miles_lite.net.ports import LOCAL_HOST, free_port


def _entry(rank: int, world_size: int, port: int, scenario: Callable[..., Any], kwargs: dict[str, Any],
           out_dir: str) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    # Two ranks share two cores: one intra-op thread each avoids oversubscription.
    torch.set_num_threads(1)
    # One process group for the whole scenario: actors created in turn reuse it.
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        result = scenario(rank, world_size, **kwargs)
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def run_ranks(scenario: Callable[..., Any], world_size: int, out_dir: Path, **kwargs: Any) -> list[Any]:
    """Run `scenario(rank, world_size, **kwargs)` in `world_size` fresh processes; return each rank's result."""
    out_dir.mkdir(parents=True, exist_ok=True)
    port = free_port(LOCAL_HOST)
    mp.spawn(_entry, args=(world_size, port, scenario, kwargs, str(out_dir)), nprocs=world_size, join=True)
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(world_size)]


def make_test_checkpoint(arch: str, out_dir: Path, vocab_size: int = 500, seed: int = 0, **shape_kw: Any) -> Path:
    """A tiny HF checkpoint with large random weights, random norm weights and biases (so that every
    tensor's placement matters), saved as safetensors."""
    from miles_lite.config.schema import TinyModelShape
    from miles_lite.trainer.tiny_hf import build_tiny_hf_model

    defaults: dict[str, dict[str, Any]] = {
        "qwen2": dict(qkv_bias=True, tie_word_embeddings=True),
        "llama": dict(qkv_bias=False, tie_word_embeddings=False),
        "qwen3": dict(qkv_bias=False, qk_norm=True, head_dim=32, tie_word_embeddings=False),
        # 8 experts, top-2, layer 0 dense: both layer kinds, every expert reached by some token.
        "qwen3_moe": dict(qkv_bias=False, qk_norm=True, head_dim=16, tie_word_embeddings=False, num_layers=3,
                          ffn_hidden_size=96, num_experts=8, num_experts_per_tok=2, moe_ffn_hidden_size=32,
                          norm_topk_prob=True, mlp_only_layers=[0]),
    }
    shape = TinyModelShape(**{**defaults[arch], **shape_kw})
    model = build_tiny_hf_model(arch, shape, vocab_size, seed, init_std=0.08)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.2 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(str(out_dir), safe_serialization=True)
    return out_dir
