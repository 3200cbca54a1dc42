"""Micro-batches that line up across the ranks of an expert-parallel group.

Every MoE layer exchanges tokens between the EP ranks (all-gather or all-to-all), forward and
backward, so those ranks must run the same number of micro-batches; megatron's all-gather
dispatcher (the CPU one) also needs the same token count per forward. When an EP group spans
data-parallel ranks, which hold different sequences, each rank's micro-batches are padded to the
group's largest `[B, S]` per position, and ranks with fewer get filler micro-batches (a copy of one
of theirs, whose loss is multiplied by zero and whose log-probs are dropped).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from miles_lite.trainer.packing import PackedMicroBatch, pack


def needs_alignment(ep_size: int, dp_size: int) -> bool:
    """True when an EP group holds ranks of different data-parallel replicas (different sequences)."""
    return ep_size > 1 and dp_size > 1


def align_micro_batches(mbs: list[PackedMicroBatch], padded: bool, group: dist.ProcessGroup | None,
                        device: torch.device) -> list[PackedMicroBatch]:
    """`mbs` extended with fillers to the group's largest count and (padded layout) padded per position
    to the group's largest `[B, S]`; every rank of `group` must call it."""
    count = torch.tensor([len(mbs)], dtype=torch.long, device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
    n = int(count.item())
    base = mbs[0] if mbs else pack([[0, 0]], [1], [0])
    out = list(mbs) + [dataclasses.replace(base, filler=True) for _ in range(n - len(mbs))]
    if not padded or n == 0:
        return out
    shapes = torch.tensor([mb.padded_shape for mb in out], dtype=torch.long, device=device)
    dist.all_reduce(shapes, op=dist.ReduceOp.MAX, group=group)
    aligned = []
    for mb, (rows, width) in zip(out, shapes.tolist(), strict=True):
        aligned.append(dataclasses.replace(mb, pad_rows=rows - len(mb.lengths), pad_width=width))
    return aligned


@torch.no_grad()
def scale_expert_grads(ddp: Any, tp_size: int) -> None:
    """Divide the accumulated routed-expert gradients by `tp_size`: under TP without sequence parallelism
    each expert sees every token once per TP rank (`moe_layer.TensorParallelMoELayer`)."""
    if tp_size == 1:
        return
    for buffer in getattr(ddp, "expert_parallel_buffers", []):
        buffer.grad_data.mul_(1.0 / tp_size)
