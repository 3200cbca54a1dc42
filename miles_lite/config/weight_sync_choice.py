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


# `weight_sync.max_probe_logp_diff` unset: the bound that fits the run (see `probe_bound`).
PROBE_BOUND_FP32 = 1e-3
PROBE_BOUND_BF16_REFERENCE = 1e-2
PROBE_BOUND_BF16_SGLANG = 0.1
PROBE_BOUND_MOE_FACTOR = 2.0
FP32_DTYPES = frozenset({"float32", "float", "fp32"})


def moe_model(cfg: MilesConfig) -> bool:
    """Whether the model routes tokens to experts (`model.shape.num_experts`, or config.json's)."""
    if not cfg.model.hf_path:
        return cfg.model.arch == "qwen3_moe" and cfg.model.shape.num_experts > 0
    import json
    from pathlib import Path

    try:
        config = json.loads((Path(cfg.model.hf_path) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    return any(isinstance(text.get(k), int) and text[k] > 0 for k in ("num_experts", "num_local_experts"))


def engines_in_fp32(cfg: MilesConfig) -> bool:
    """Whether the engines compute in fp32: reference engines unless `rollout.reference_args.dtype` says
    otherwise; SGLang only with `rollout.sglang_args.dtype=float32` (it serves in the checkpoint's dtype)."""
    if cfg.rollout.backend == "reference":
        return str(flag_value(cfg.rollout.reference_args, "dtype", "float32")) in FP32_DTYPES
    return str(flag_value(cfg.rollout.sglang_args, "dtype", "auto")) in FP32_DTYPES


def probe_bound(cfg: MilesConfig) -> tuple[float, str]:
    """The per-token |logp diff| mean a verified push may show, and why: `weight_sync.max_probe_logp_diff` when
    set, else by precision, engines and architecture. Measured gaps of correct pushes (docs/benchmarks.md):

    - fp32 trainer and fp32 engines: the same arithmetic up to summation order (0.0000 on a GPU): 1e-3;
    - bf16 on one side (a bf16 or FP8 trainer scores the probe in bf16) against fp32 reference engines: 0.0006-0.0012
      on tiny dense models: 1e-2;
    - bf16 against SGLang's bf16 kernels: 0.010 on a trained 0.5B model, 0.078 on a random one: 0.1;
    - a mixture-of-experts model twice that: a bf16 router breaks near ties the other way now and then, and a
      token sent to another expert costs far more than rounding (0.0010-0.0014 on tiny Qwen3-MoE against 0.0006-0.0012
      dense).

    A push that loads the wrong weights differs by tenths of a nat or more (two random models of hidden size 256:
    0.7 nats per token); an engine that kept its old weights is named by the probe's unchanged scores instead."""
    given = cfg.weight_sync.max_probe_logp_diff
    if given is not None:
        return float(given), ""
    fp32 = cfg.trainer.precision == "fp32" and engines_in_fp32(cfg)
    moe = moe_model(cfg)
    if fp32:
        bound, what = PROBE_BOUND_FP32, "an fp32 trainer and fp32 engines"
    elif cfg.rollout.backend == "sglang":
        bound, what = PROBE_BOUND_BF16_SGLANG, "bf16 against SGLang engines"
    else:
        bound, what = PROBE_BOUND_BF16_REFERENCE, "bf16 against fp32 reference engines"
    if moe and not fp32:
        bound *= PROBE_BOUND_MOE_FACTOR
    model = "a mixture-of-experts model" if moe else "a dense model"
    return bound, f" (chosen for {what}, {model}; set weight_sync.max_probe_logp_diff to override)"
