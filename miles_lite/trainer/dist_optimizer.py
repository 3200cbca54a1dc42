"""Megatron's distributed optimizer state <-> per-parameter tensors, independent of the data-parallel size.

With `trainer.use_distributed_optimizer=true` every data-parallel rank steps only its range of each
parameter's flattened elements (Megatron's flat buffer shards): its fp32 main parameters and Adam moments
cover that range. A checkpoint stores per-parameter tensors instead (the TP-local shape, as for the plain
optimizer, see `checkpoint/trainer_state.py`): at save the ranges are gathered over the data-parallel group
to its rank 0, which writes them; at load every rank cuts its own range out of the full tensors. The ranges
of a DP size need not be those of the run that saved, so a run saved at DP 2 resumes at DP 1 and back.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

# The Adam state a main-parameter range carries besides its value.
MOMENTS = ("exp_avg", "exp_avg_sq")


def leaves(optimizer: Any) -> list[Any]:
    """The Megatron optimizers under `optimizer` (a `ChainedOptimizer` holds several)."""
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def is_distributed(optimizer: Any) -> bool:
    """Whether `optimizer` shards its state over the data-parallel ranks (Megatron's DistributedOptimizer)."""
    return any(hasattr(leaf, "model_param_group_index_map") for leaf in leaves(optimizer))


@dataclass
class ParamState:
    """One parameter's optimizer state, whole (TP-local shape): fp32 main value, Adam moments, step count."""

    master: Tensor
    moments: dict[str, Tensor]
    step: Any = None


def _main_params(leaf: Any) -> dict[int, Tensor]:
    """Model parameter id -> the fp32 main range this rank steps. Megatron orders each torch parameter group
    fp32 parameters first, then the main copies of bf16 ones, so its group/position map is not used."""
    out: dict[int, Tensor] = {}
    for models, mains in [*zip(leaf.model_float16_groups, leaf.shard_fp32_from_float16_groups, strict=True),
                          *zip(leaf.model_fp32_groups, leaf.shard_fp32_groups, strict=True)]:
        out.update({id(m): main for m, main in zip(models, mains, strict=True)})
    return out


def _local_ranges(optimizer: Any, model: torch.nn.Module) -> list[tuple[Any, str, Tensor, Tensor, int, int]]:
    """(leaf optimizer, name, model parameter, main range, start, end) of every range this rank steps."""
    out = []
    for leaf in leaves(optimizer):
        mains = _main_params(leaf)
        for name, param in model.named_parameters():
            if id(param) in mains:
                rng = leaf._get_model_param_range_map(param)["param"]
                out.append((leaf, name, param, mains[id(param)], int(rng.start), int(rng.end)))
    return out


@dataclass
class DistributedOptimizerState:
    """What a checkpoint keeps of a distributed optimizer: whole per-parameter states (on data-parallel rank 0
    after `gather_state`; every rank's when loading) and each torch parameter group's own `step` (the fused
    Adam kernels of TransformerEngine and Apex count steps there, torch's Adam per parameter)."""

    params: dict[str, ParamState] | None
    group_steps: list[list[Any]]


def group_steps(optimizer: Any) -> list[list[Any]]:
    return [[g.get("step") for g in leaf.optimizer.param_groups] for leaf in leaves(optimizer)]


def set_group_steps(optimizer: Any, steps: list[list[Any]]) -> None:
    for leaf, saved in zip(leaves(optimizer), steps, strict=True):
        for group, step in zip(leaf.optimizer.param_groups, saved, strict=True):
            if step is not None:
                group["step"] = step


@torch.no_grad()
def gather_state(optimizer: Any, model: torch.nn.Module, dp_group: Any) -> dict[str, ParamState] | None:
    """Every parameter's whole optimizer state on data-parallel rank 0 (None on the others); a collective
    of the data-parallel group. Parameters never stepped carry no moments."""
    local: dict[str, list[tuple[int, int, dict[str, Any]]]] = {}
    for leaf, name, _, main, start, end in _local_ranges(optimizer, model):
        if main.numel() != end - start:
            raise RuntimeError(f"{name}: main range of {main.numel()} elements for its range [{start}, {end})")
        tensors = {"param": main, **leaf.optimizer.state.get(main, {})}
        local.setdefault(name, []).append((start, end, {
            k: v.detach().to("cpu", copy=True) if isinstance(v, Tensor) else v for k, v in tensors.items()}))
    if dp_group is None or dist.get_world_size(dp_group) == 1:
        parts = [local]
    else:
        parts = [None] * dist.get_world_size(dp_group)
        rank0 = dist.get_global_rank(dp_group, 0)
        dist.gather_object(local, parts if dist.get_rank(dp_group) == 0 else None, dst=rank0, group=dp_group)
        if dist.get_rank(dp_group) != 0:
            return None
    out: dict[str, ParamState] = {}
    for name, param in model.named_parameters():
        pieces = [piece for part in parts for piece in part.get(name, [])]
        covered = sum(end - start for start, end, _ in pieces)
        if covered != param.numel():
            raise RuntimeError(f"the distributed optimizer's ranges of {name} cover {covered} of its "
                               f"{param.numel()} elements")
        keys = set.intersection(*(set(t) for _, _, t in pieces)) & {"param", *MOMENTS}
        full = {k: torch.empty(param.numel(), dtype=torch.float32) for k in keys}
        for start, end, tensors in pieces:
            for k in keys:
                full[k][start:end] = tensors[k].float().view(-1)
        step = next((t["step"] for _, _, t in pieces if "step" in t), None)
        out[name] = ParamState(full["param"].view(param.shape),
                               {k: full[k].view(param.shape) for k in MOMENTS if k in full}, step)
    return out


@torch.no_grad()
def scatter_state(optimizer: Any, model: torch.nn.Module, states: Mapping[str, ParamState]) -> None:
    """Load whole per-parameter states (`gather_state`'s, from any DP size) into this rank's ranges."""
    for leaf, name, param, main, start, end in _local_ranges(optimizer, model):
        state = states.get(name)
        source = state.master if state is not None else param.detach()
        main.copy_(source.reshape(-1)[start:end].to(main.device, main.dtype))
        slot = leaf.optimizer.state[main]
        slot.clear()
        if state is None or not state.moments:
            continue  # never stepped when saved: no moments, as a fresh optimizer
        for key, full in state.moments.items():
            slot[key] = full.reshape(-1)[start:end].to(main.device, main.dtype).clone()
        if state.step is not None:
            slot["step"] = state.step.clone() if isinstance(state.step, Tensor) else state.step



def _offloaded(leaf: Any) -> Any | None:
    """Megatron's CPU-offloaded optimizer under a distributed-optimizer leaf (`trainer.offload.optimizer_cpu`:
    a `HybridDeviceOptimizer`), else None."""
    inner = getattr(leaf, "optimizer", None)
    return inner if hasattr(inner, "sub_optimizers") and hasattr(inner, "_init_sub_optimizers") else None


@torch.no_grad()
def finish_offloaded_load(optimizer: Any) -> None:
    """After `scatter_state` and `set_group_steps`, hand the loaded state to Megatron's CPU-offloaded optimizer.

    That optimizer steps host copies of the main parameters with CPU Adam optimizers of its own and copies the
    result back to the device after every step; its `state` mapping is rebuilt from theirs after each step.
    Loading into the device ranges and that mapping alone would leave the host copies at their initial values
    and the CPU optimizers without moments: the first step after a resume would undo it. So the host copies are
    made again from the loaded ranges (what the optimizer's own load hook does) and each CPU optimizer gets its
    parameter's moments and step (a per-parameter step, as torch's Adam keeps it; a checkpoint of a fused-Adam
    run keeps its steps per group)."""
    for leaf in leaves(optimizer):
        hybrid = _offloaded(leaf)
        if hybrid is None:
            continue
        loaded = {p: dict(hybrid.state.get(p, {})) for group in hybrid.param_groups for p in group["params"]}
        group_step = {id(p): g.get("step") for g in hybrid.param_groups for p in g["params"]}
        hybrid._init_sub_optimizers()  # new host copies of the (loaded) device ranges, CPU optimizers without state
        hybrid._sync_hdo_param_groups_to_sub_optimizers()
        for sub in hybrid.sub_optimizers:
            for group in sub.param_groups:
                for inner in group["params"]:
                    orig = hybrid.inner_param_to_orig_param[inner]
                    if not torch.equal(inner.detach().cpu(), orig.detach().float().cpu()):
                        raise RuntimeError("the CPU-offloaded optimizer's host copy differs from the loaded main "
                                           "parameter after the resume")
                    saved = loaded.get(orig, {})
                    if not all(k in saved for k in MOMENTS):
                        continue  # never stepped when saved: a fresh state, as a new optimizer's
                    step = saved.get("step", group_step.get(id(orig)))
                    if step is None:
                        raise RuntimeError("a checkpoint's Adam moments without a step count; cannot resume the "
                                           "CPU-offloaded optimizer from it")
                    state = {k: saved[k].to(inner.device, inner.dtype).clone() for k in MOMENTS}
                    state["step"] = torch.tensor(float(step), dtype=torch.float32, device=inner.device)
                    sub.state[inner] = state
        hybrid._sync_sub_optimizers_state_to_hdo()
