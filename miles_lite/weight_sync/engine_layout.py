"""An engine's TP-sharded parameter store, laid out like SGLang's parameters, and its inverse.

Engine rank r of an engine with TP `tp` holds one tensor per SGLang parameter: `qkv_proj` = [q; k; v]
of the rank (KV heads replicated when tp exceeds them), `gate_up_proj` = [gate; up] of the rank,
row-parallel tensors split on dim 1, the vocabulary split on dim 0 (padded rows zero), norms whole;
a MoE layer's routed experts stacked as SGLang's `FusedMoE` holds them: `experts.w13_weight` [experts, [gate; up]
of the rank, hidden] and `experts.w2_weight` [experts, hidden, the rank's columns of down_proj].
Which rows of the full HF tensor each rank holds is `plan.engine_segments` (the same slicing the
reshard plan targets) and where an HF tensor sits inside a fused parameter is `plan.fused_offset`.

- `shard_full` / `make_stores`: full HF tensors -> each rank's store (what an engine's loader does);
- `place_shard`: one HF-named local shard (what a rank receives) -> its place in the rank's store;
- `assemble`: every rank's store -> full HF tensors (the inverse, what the reference engine computes with).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence

import torch

from miles_lite.weight_sync.plan import EngineSpec, ParamSpec, PlanError, engine_segments, fused_offset

# HF tensor suffix -> SGLang fused parameter suffix (Qwen2/Llama stacked_params_mapping).
_FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
          "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}

# A routed expert's HF tensor: `<layer>.mlp.experts.<expert>.<projection>.weight`.
_EXPERT = re.compile(r"\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")

# One engine rank's parameters: SGLang parameter name -> local tensor.
Store = dict[str, torch.Tensor]


def expert_slot(hf_name: str) -> tuple[str, int] | None:
    """The SGLang `FusedMoE` parameter and expert index of a routed expert's HF tensor (None for others):
    `...mlp.experts.3.up_proj.weight` -> (`...mlp.experts.w13_weight`, 3)."""
    match = _EXPERT.search(hf_name)
    if match is None:
        return None
    stacked = "w2_weight" if match.group(2) == "down_proj" else "w13_weight"
    return f"{hf_name[:match.start()]}.experts.{stacked}", int(match.group(1))


def sglang_param_name(hf_name: str) -> str:
    """The SGLang parameter an HF tensor loads into (`...q_proj.weight` -> `...qkv_proj.weight`,
    `...experts.3.gate_proj.weight` -> `...experts.w13_weight`)."""
    slot = expert_slot(hf_name)
    if slot is not None:
        return slot[0]
    parts = hf_name.split(".")
    if len(parts) >= 2 and parts[-2] in _FUSED:
        parts[-2] = _FUSED[parts[-2]]
    return ".".join(parts)


def expert_index(hf_name: str) -> int:
    """The expert a routed expert's HF tensor belongs to; -1 for every other tensor."""
    slot = expert_slot(hf_name)
    return -1 if slot is None else slot[1]


def expert_counts(specs: Iterable[ParamSpec]) -> dict[str, int]:
    """How many experts each stacked expert parameter holds (`...experts.w13_weight` -> 8)."""
    counts: dict[str, int] = {}
    for spec in specs:
        slot = expert_slot(spec.name)
        if slot is not None:
            counts[slot[0]] = max(counts.get(slot[0], 0), slot[1] + 1)
    return counts


def local_shape(spec: ParamSpec, engine: EngineSpec, rank: int) -> tuple[int, ...]:
    """Shape of engine rank `rank`'s local shard of HF tensor `spec` (elements)."""
    _, local = engine_segments(spec, engine, rank)
    shape = list(spec.shape)
    shape[spec.dim] = local
    return tuple(shape)


def store_shapes(specs: Sequence[ParamSpec], engine: EngineSpec, rank: int) -> dict[str, tuple[int, ...]]:
    """Shape of every SGLang parameter on engine rank `rank` (fused parameters: parts stacked on dim 0;
    routed experts: one more leading dimension, the expert)."""
    shapes: dict[str, list[int]] = {}
    for spec in specs:
        shape = local_shape(spec, engine, rank)
        target, expert = sglang_param_name(spec.name), expert_index(spec.name)
        rows = fused_offset(spec, engine.tp) + shape[0]
        if target in shapes and (spec.kind in ("qkv", "gate_up") or expert >= 0):
            shapes[target][0] = max(shapes[target][0], rows)
        elif target in shapes:
            raise PlanError(f"{spec.name} maps to SGLang parameter {target!r}, already taken by another tensor")
        else:
            shapes[target] = [rows, *shape[1:]]
    stacked = expert_counts(specs)
    return {name: (stacked[name], *shape) if name in stacked else tuple(shape) for name, shape in shapes.items()}


def _region(store: Store, spec: ParamSpec, tp: int, rows: int) -> torch.Tensor:
    """The view of `store` that holds `spec`'s local shard (`rows` long along dim 0, within its expert)."""
    target, expert = sglang_param_name(spec.name), expert_index(spec.name)
    if target not in store:
        raise PlanError(f"{spec.name}: the engine store has no parameter {target!r}")
    param = store[target] if expert < 0 else store[target][expert]
    return param.narrow(0, fused_offset(spec, tp), rows)


def place_shard(store: Store, spec: ParamSpec, engine: EngineSpec, local: torch.Tensor) -> None:
    """Copy one HF-named local shard (as received by an engine rank) into its place in that rank's store."""
    expected = local_shape(spec, engine, 0)  # every rank's shard of a tensor has one shape
    if tuple(local.shape) != expected:
        raise PlanError(f"{spec.name}: received shard of shape {tuple(local.shape)}, the engine (tp={engine.tp}) "
                        f"expects {expected}")
    _region(store, spec, engine.tp, expected[0]).copy_(local)


def shard_full(spec: ParamSpec, full: torch.Tensor, engine: EngineSpec, rank: int) -> torch.Tensor:
    """Engine rank `rank`'s local shard of one full HF tensor (vocab padding rows zero)."""
    if tuple(full.shape) != spec.shape:
        raise PlanError(f"{spec.name}: full tensor of shape {tuple(full.shape)}, expected {spec.shape}")
    segments, _ = engine_segments(spec, engine, rank)
    out = full.new_zeros(local_shape(spec, engine, rank))
    for start, stop, _, local_start in segments:
        out.narrow(spec.dim, local_start, stop - start).copy_(full.narrow(spec.dim, start, stop - start))
    return out


def make_stores(specs: Sequence[ParamSpec], full: Mapping[str, torch.Tensor], engine: EngineSpec,
                dtype: torch.dtype | None = None) -> list[Store]:
    """Every rank's store from full HF tensors (`dtype` defaults to each tensor's own)."""
    stores = []
    for rank in range(engine.tp):
        shapes = store_shapes(specs, engine, rank)
        store: Store = {}
        for spec in specs:
            target = sglang_param_name(spec.name)
            if target not in store:
                store[target] = torch.zeros(shapes[target], dtype=dtype or full[spec.name].dtype)
            place_shard(store, spec, engine, shard_full(spec, full[spec.name], engine, rank))
        stores.append(store)
    return stores


def assemble(specs: Sequence[ParamSpec], stores: Sequence[Store], engine: EngineSpec,
             names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
    """Full HF tensors rebuilt from every rank's store (the inverse of `make_stores`); `names` restricts.

    Replicated blocks (norms, KV heads shared by several ranks) are taken from the last rank holding
    them: the stores of a correctly loaded engine agree on them.
    """
    if len(stores) != engine.tp:
        raise PlanError(f"assemble got {len(stores)} rank stores for engine tp={engine.tp}")
    by_name = {s.name: s for s in specs}
    wanted = list(by_name) if names is None else list(names)
    unknown = [n for n in wanted if n not in by_name]
    if unknown:
        raise PlanError(f"unknown parameter names {unknown[:5]}; the engine holds e.g. {list(by_name)[:3]}")
    out = {}
    for name in wanted:
        spec = by_name[name]
        full: torch.Tensor | None = None
        for rank, store in enumerate(stores):
            segments, _ = engine_segments(spec, engine, rank)
            shard = _region(store, spec, engine.tp, local_shape(spec, engine, rank)[0])
            if full is None:
                full = shard.new_empty(spec.shape)
            for start, stop, _, local_start in segments:
                full.narrow(spec.dim, start, stop - start).copy_(shard.narrow(spec.dim, local_start, stop - start))
        assert full is not None
        out[name] = full
    return out
