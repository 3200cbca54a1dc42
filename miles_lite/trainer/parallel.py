"""torch.distributed and megatron `parallel_state` set-up for one trainer rank (TP x DP; PP = 1)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from miles_lite.config.schema import TrainerConfig
from miles_lite.net.rendezvous import store_from_url
from miles_lite.trainer import cpu_compat


@dataclass(frozen=True)
class ParallelInfo:
    """This rank's coordinates. `tp_group` / `dp_group` are None when that dimension is 1."""

    rank: int
    world_size: int
    tp_rank: int
    tp_size: int
    dp_rank: int
    dp_size: int
    tp_group: dist.ProcessGroup | None
    dp_group: dist.ProcessGroup | None
    # Expert parallelism (MoE): routed experts split over `ep_size` ranks; the expert-data-parallel
    # replicas of one expert shard are `edp_size` ranks. Groups are None when that dimension is 1.
    ep_rank: int = 0
    ep_size: int = 1
    ep_group: dist.ProcessGroup | None = None
    edp_rank: int = 0
    edp_size: int = 1
    # True when init_parallel created the default process group (and so shutdown should destroy it).
    owns_process_group: bool = False


def init_parallel(
    trainer: TrainerConfig,
    rank: int,
    world_size: int,
    device: str,
    init_method: str | None = None,
    timeout_s: float = 300.0,
) -> ParallelInfo:
    """Join the trainer's process group and build megatron's TP/DP groups.

    Args:
        trainer: `tp`, `dp`, `pp`, `seed`.
        rank / world_size: this process among the trainer ranks (world_size must be tp * dp).
        device: "cpu" (gloo) or "gpu" (NCCL, one GPU per rank: LOCAL_RANK or rank % device count).
        init_method: `tcp://host:port` rendezvous, hosted by rank 0 on that address only (None: from
            MASTER_ADDR/MASTER_PORT).
        timeout_s: collective timeout.
    """
    if trainer.pp != 1:
        raise ValueError(
            f"trainer.pp={trainer.pp}: pipeline parallelism is not supported; use trainer.pp=1 with trainer.tp/dp"
        )
    if trainer.world_size != world_size:
        raise ValueError(
            f"world_size={world_size} must equal trainer.tp * trainer.dp = {trainer.tp} * {trainer.dp}; "
            "launch tp * dp trainer ranks or change trainer.tp/trainer.dp"
        )
    if world_size % trainer.ep:
        raise ValueError(f"trainer.ep={trainer.ep} must divide the trainer's tp * dp = {world_size} ranks "
                         "(experts are placed on expert-parallel ranks within them)")
    if device == "gpu":
        local = int(os.environ.get("LOCAL_RANK", rank % max(torch.cuda.device_count(), 1)))
        torch.cuda.set_device(local)
    owns = not dist.is_initialized()
    if owns:
        timeout = timedelta(seconds=timeout_s)
        if init_method is None:
            init_method = f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        dist.init_process_group(
            backend="nccl" if device == "gpu" else "gloo",
            # Rank 0's store listens on the rendezvous address only (torch's own listens on every interface).
            store=store_from_url(init_method, rank, world_size, timeout),
            rank=rank,
            world_size=world_size,
            timeout=timeout,
        )
    elif dist.get_world_size() != world_size or dist.get_rank() != rank:
        raise RuntimeError(
            f"torch.distributed is already initialised as rank {dist.get_rank()}/{dist.get_world_size()}, "
            f"not {rank}/{world_size}; one trainer rank per process"
        )
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        # A second actor in the same process (e.g. after close() of the first) rebuilds the groups.
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=trainer.tp, pipeline_model_parallel_size=1,
                                 expert_model_parallel_size=trainer.ep, expert_tensor_parallel_size=1)
    cpu_compat.patch_cuda_queries()
    cpu_compat.use_torch_moe_kernels()
    tp_rank = ps.get_tensor_model_parallel_rank()
    cpu_compat.seed_model_parallel(trainer.seed, tp_rank)
    return ParallelInfo(
        rank=rank,
        world_size=world_size,
        tp_rank=tp_rank,
        tp_size=trainer.tp,
        dp_rank=ps.get_data_parallel_rank(),
        dp_size=ps.get_data_parallel_world_size(),
        tp_group=ps.get_tensor_model_parallel_group() if trainer.tp > 1 else None,
        dp_group=ps.get_data_parallel_group() if trainer.dp > 1 else None,
        ep_rank=ps.get_expert_model_parallel_rank(),
        ep_size=trainer.ep,
        ep_group=ps.get_expert_model_parallel_group() if trainer.ep > 1 else None,
        edp_rank=ps.get_expert_data_parallel_rank(),
        edp_size=ps.get_expert_data_parallel_world_size(),
        owns_process_group=owns,
    )


def shutdown_parallel(info: ParallelInfo) -> None:
    """Destroy megatron's groups, and the default process group if `init_parallel` created it."""
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    if info.owns_process_group and dist.is_initialized():
        dist.destroy_process_group()
