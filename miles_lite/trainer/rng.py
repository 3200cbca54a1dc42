"""RNG state of a trainer rank: torch CPU/CUDA generators and megatron's model-parallel streams."""

from __future__ import annotations

from typing import Any

import torch


def capture_rank_rng() -> dict[str, Any]:
    """Every RNG stream this rank draws from (CPU generator, CUDA generator, megatron tracker)."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "tracker": {k: v.clone() for k, v in get_cuda_rng_tracker().get_states().items()},
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rank_rng(state: dict[str, Any]) -> None:
    """Put back what `capture_rank_rng` returned."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    torch.set_rng_state(state["torch"])
    get_cuda_rng_tracker().set_states({k: v.clone() for k, v in state["tracker"].items()})
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
