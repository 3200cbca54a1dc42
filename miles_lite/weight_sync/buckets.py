"""Buckets: consecutive runs of HF tensors, each at most `max_bytes`, moved by one update call.

Every engine rank and every transport must see the same buckets in the same order (a bucket is one
`update_weights_from_distributed` call, one collective round), so bucketing depends only on the
plan and the byte limit: model order, greedy, a tensor larger than the limit alone in its bucket.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from miles_lite.weight_sync.plan import RankPlan, ReshardPlan

MIB = 1 << 20


@dataclass(frozen=True)
class Bucket:
    """HF tensor names moved together (model order) and the bytes that bound the bucket's size."""

    index: int
    names: tuple[str, ...]
    nbytes: int


def make_buckets(sized_names: Sequence[tuple[str, int]], max_bytes: int) -> list[Bucket]:
    """Group `(name, nbytes)` pairs, in order, into buckets of at most `max_bytes` bytes.

    A single tensor above the limit gets a bucket of its own (tensors are never split).
    """
    if max_bytes <= 0:
        raise ValueError(f"bucket size {max_bytes} bytes must be > 0; set weight_sync.bucket_mib to a positive MiB")
    buckets: list[Bucket] = []
    names: list[str] = []
    size = 0
    for name, nbytes in sized_names:
        if names and size + nbytes > max_bytes:
            buckets.append(Bucket(len(buckets), tuple(names), size))
            names, size = [], 0
        names.append(name)
        size += nbytes
    if names:
        buckets.append(Bucket(len(buckets), tuple(names), size))
    return buckets


def full_buckets(full_plan: RankPlan, max_bytes: int) -> list[Bucket]:
    """Buckets of full HF tensors (broadcast and disk paths)."""
    return make_buckets([(s.name, s.nbytes) for s in full_plan.shards], max_bytes)


def shard_buckets(plan: ReshardPlan, max_bytes: int) -> list[Bucket]:
    """Buckets of per-rank shards: a tensor weighs its largest shard over every engine rank of the fleet,
    so no rank's bucket exceeds `max_bytes` (unless a single shard does)."""
    rank_plans = [rp for ranks in plan.ranks for rp in ranks]
    if not rank_plans:
        return []
    sizes: dict[str, int] = {}
    for rp in rank_plans:
        for shard in rp.shards:
            sizes[shard.name] = max(sizes.get(shard.name, 0), shard.nbytes)
    return make_buckets([(s.name, sizes[s.name]) for s in rank_plans[0].shards], max_bytes)


def bucket_bytes_limit(bucket_mib: int) -> int:
    """`weight_sync.bucket_mib` in bytes, validated."""
    if bucket_mib <= 0:
        raise ValueError(f"weight_sync.bucket_mib={bucket_mib} must be a positive number of MiB (default 512)")
    return bucket_mib * MIB
