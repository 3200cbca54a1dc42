"""Which weight-sync combinations work, and which collective backend the weight-update group uses.

transport x mode x rollout.backend:
- distributed / shard: both backends, through the weight-loader plugin (each engine rank receives
  its own slices from the trainer ranks holding them);
- distributed / full: both backends, SGLang's own `init_weights_update_group` /
  `update_weights_from_distributed` (full HF tensors broadcast from one process);
- disk: both backends (safetensors on a directory the engines can read);
- ipc: SGLang only (torch's pickled CUDA tensors: trainer and engines on one torch build), engines on the
  trainer's GPUs (`cluster.placement=colocated`);
- ipc_handles: SGLang only, colocated, the engines started with the IPC weight loader plugin
  (`IPC_HANDLES_LOADER` in `--custom-weight-loader`): driver-level CUDA IPC, any torch builds.
`mode` only selects between the two distributed variants.

The group's backend (`weight_sync.backend`): auto picks NCCL when the trainer is on GPUs and every
engine is an SGLang engine on other GPUs, gloo otherwise (reference engines are CPU processes, and
NCCL refuses two ranks of one group on the same GPU; gloo stages GPU tensors through host memory).
"""

from __future__ import annotations

import torch

from miles_lite.config.engine_flags import flag_value
from miles_lite.config.schema import IPC_HANDLES_LOADER, MilesConfig

BACKENDS = ("auto", "nccl", "gloo")


def trainer_on_gpu(cfg: MilesConfig) -> bool:
    """Whether the trainer ranks run on GPUs (`trainer.device`, auto = when CUDA is present)."""
    if cfg.trainer.device == "auto":
        return torch.cuda.is_available()
    return cfg.trainer.device == "gpu"


def shared_gpus(cfg: MilesConfig) -> list[int]:
    """GPUs (indices on this machine) that both a trainer rank and an engine use, for `cluster.mode=local`;
    colocated placement shares by definition ([-1] stands for "all")."""
    if cfg.cluster.placement == "colocated":
        return [-1]
    if cfg.cluster.mode != "local" or cfg.rollout.backend != "sglang":
        return []
    trainer = set(range(cfg.trainer.tp * cfg.trainer.dp))
    engines: set[int] = set()
    for index in range(cfg.rollout.engines):
        base = int(flag_value(cfg.rollout.sglang_args, "base_gpu_id", index * cfg.rollout.engine_tp))
        engines |= set(range(base, base + cfg.rollout.engine_tp))
    return sorted(trainer & engines)


def nccl_obstacle(cfg: MilesConfig) -> str | None:
    """Why NCCL cannot carry this run's weight-update group (None when it can)."""
    if cfg.rollout.backend != "sglang":
        return f"rollout.backend={cfg.rollout.backend} engines run on CPU"
    if not trainer_on_gpu(cfg):
        return "the trainer runs on CPU"
    shared = shared_gpus(cfg)
    if shared:
        where = "cluster.placement=colocated" if shared == [-1] else f"GPUs {shared} hold a trainer rank and an engine"
        return f"{where}, and NCCL refuses two ranks of one group on the same GPU"
    return None


def collective_backend(cfg: MilesConfig) -> str:
    """The weight-update group's backend: `weight_sync.backend`, auto resolved (see the module docstring)."""
    if cfg.weight_sync.backend != "auto":
        return cfg.weight_sync.backend
    return "gloo" if nccl_obstacle(cfg) else "nccl"


def weight_sync_problems(cfg: MilesConfig) -> list[str]:
    """Combinations that cannot work, each naming the fix."""
    ws, problems = cfg.weight_sync, []
    if ws.transport in ("ipc", "ipc_handles") and cfg.rollout.backend != "sglang":
        problems.append(f"weight_sync.transport={ws.transport} hands CUDA IPC handles to SGLang engines; with "
                        f"rollout.backend={cfg.rollout.backend} use weight_sync.transport=distributed or disk")
    if ws.transport in ("ipc", "ipc_handles") and cfg.cluster.placement != "colocated":
        problems.append(f"weight_sync.transport={ws.transport} needs cluster.placement=colocated (engines on the "
                        "trainer's GPUs)")
    if ws.transport == "ipc_handles" and cfg.rollout.backend == "sglang" and not cfg.rollout.engine_urls:
        loaders = flag_value(cfg.rollout.sglang_args, "custom_weight_loader") or []
        if IPC_HANDLES_LOADER not in (loaders if isinstance(loaders, list | tuple) else [loaders]):
            problems.append(f"weight_sync.transport=ipc_handles: SGLang engines must load the push with "
                            f"{IPC_HANDLES_LOADER}; add '+rollout.sglang_args.custom_weight_loader="
                            f"[{IPC_HANDLES_LOADER}]'")
    sglang_ep = int(flag_value(cfg.rollout.sglang_args, "ep_size") or 1)
    writes_params = ws.transport in ("ipc", "ipc_handles") or (ws.transport == "distributed" and ws.mode == "shard")
    if cfg.rollout.backend == "sglang" and sglang_ep > 1 and writes_params:
        # These pushes write each engine rank's parameters directly, in the layout of SGLang's tensor-parallel
        # MoE (every expert on every rank, split by TP); an expert-parallel engine holds other experts per rank.
        how = "weight_sync.mode=shard" if ws.transport == "distributed" else f"weight_sync.transport={ws.transport}"
        problems.append(f"rollout.sglang_args.ep_size={sglang_ep} with {how}: pushes into SGLang's parameters "
                        "follow its tensor-parallel MoE layout; use weight_sync.mode=full or weight_sync.transport="
                        "disk (SGLang's own loader places the experts), or drop ep_size")
    if ws.transport == "distributed" and ws.backend == "nccl":
        obstacle = nccl_obstacle(cfg)
        if obstacle:
            problems.append(f"weight_sync.backend=nccl: {obstacle}; use weight_sync.backend=gloo (or auto)")
    return problems
