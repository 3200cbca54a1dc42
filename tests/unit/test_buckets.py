"""Buckets: order kept, size bound kept, oversize tensors alone, identical for every rank."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from miles_lite.weight_sync.buckets import MIB, bucket_bytes_limit, full_buckets, make_buckets, shard_buckets
from miles_lite.weight_sync.plan import EngineSpec, ParamSpec, build_plan, full_tensor_plan


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 100), max_size=30), st.integers(1, 120))
def test_buckets_keep_order_and_bound(sizes, limit):
    items = [(f"t{i}", n) for i, n in enumerate(sizes)]
    buckets = make_buckets(items, limit)
    assert [n for b in buckets for n in b.names] == [name for name, _ in items]
    assert [b.index for b in buckets] == list(range(len(buckets)))
    for b in buckets:
        assert b.nbytes == sum(dict(items)[n] for n in b.names)
        assert b.nbytes <= limit or len(b.names) == 1
    # Greedy: the next bucket's first tensor would not have fitted into the previous one.
    for prev, nxt in zip(buckets, buckets[1:], strict=False):
        assert prev.nbytes + dict(items)[nxt.names[0]] > limit


def test_example_split():
    buckets = make_buckets([("a", 3), ("b", 3), ("c", 9), ("d", 1)], 6)
    assert [b.names for b in buckets] == [("a", "b"), ("c",), ("d",)]


def test_shard_buckets_use_the_largest_rank_shard():
    specs = [ParamSpec("embed", (128, 8), kind="vocab", trainer_padded_vocab=128),
             ParamSpec("norm", (8,)), ParamSpec("o", (8, 8), kind="row")]
    plan = build_plan(specs, 1, [EngineSpec("a", 1), EngineSpec("b", 2)])
    buckets = shard_buckets(plan, 128 * 8 * 4)
    assert buckets[0].names == ("embed",) and buckets[0].nbytes == 128 * 8 * 4  # tp=1 engine's full embed
    assert buckets[1].names == ("norm", "o") and buckets[1].nbytes == 32 + 256
    assert [b.names for b in full_buckets(full_tensor_plan(specs, 1), 1 << 30)] == [("embed", "norm", "o")]


def test_bad_limit_names_the_config_field():
    with pytest.raises(ValueError, match="bucket_mib"):
        bucket_bytes_limit(0)
    assert bucket_bytes_limit(512) == 512 * MIB
