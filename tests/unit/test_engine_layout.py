"""Engine-side store: slicing full tensors into SGLang-laid-out rank stores and assembling them back.

The reference for the per-rank slices is `sglang_shard` in test_plan.py (written from SGLang's loaders);
the round trip must be the identity, and the plan's transfers placed into a store must give the
same store as slicing the full tensors.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from test_plan import full_tensors, geometries, megatron_shards, qwen2_specs, sglang_shard

from miles_lite.weight_sync.engine_layout import (
    assemble,
    make_stores,
    place_shard,
    sglang_param_name,
    store_shapes,
)
from miles_lite.weight_sync.plan import EngineSpec, PlanError, apply_rank_plan, build_plan, fused_offset


@settings(max_examples=60, deadline=None)
@given(geometries())
def test_stores_assemble_to_the_full_tensors_and_match_the_plan(g):
    specs = qwen2_specs(g["hidden"], g["heads"], g["kv"], g["hd"], g["ffn"], g["vocab"], g["trainer_padded_vocab"],
                        tied=g["seed"] % 2 == 0)
    full = full_tensors(specs, g["seed"])
    trainer = megatron_shards(specs, full, g["trainer_tp"])
    engines = [EngineSpec(f"e{i}", tp, vocab_pad_to=g["pad_to"]) for i, tp in enumerate(g["engines"])]
    plan = build_plan(specs, g["trainer_tp"], engines)
    for engine, rank_plans in zip(engines, plan.ranks, strict=True):
        stores = make_stores(specs, full, engine)
        back = assemble(specs, stores, engine)
        assert back.keys() == full.keys()
        for name, tensor in full.items():
            assert torch.equal(back[name], tensor), (engine.tp, name)
        for rp, store in zip(rank_plans, stores, strict=True):
            assert {k: tuple(v.shape) for k, v in store.items()} == store_shapes(specs, engine, rp.rank)
            # SGLang's own slicing lands at the fused offset of the rank's parameter.
            for spec in specs:
                want = sglang_shard(spec, full[spec.name], engine.tp, rp.rank, g["pad_to"])
                got = store[sglang_param_name(spec.name)].narrow(0, fused_offset(spec, engine.tp), want.shape[0])
                assert torch.equal(got, want), (engine.tp, rp.rank, spec.name)
            # What a rank receives through the plan fills the same store.
            received = {k: torch.full_like(v, float("nan")) for k, v in store.items()}
            for name, local in apply_rank_plan(rp, trainer).items():
                place_shard(received, next(s for s in specs if s.name == name), engine, local)
            for key in store:
                assert torch.equal(received[key], store[key]), (engine.tp, rp.rank, key)


def test_kv_heads_replicated_when_engine_tp_exceeds_them():
    specs = qwen2_specs(hidden=4, heads=4, kv=2, hd=2, ffn=8, vocab=16, trainer_padded_vocab=16)
    full = full_tensors(specs, 0)
    engine = EngineSpec("e", 4, vocab_pad_to=1)
    stores = make_stores(specs, full, engine)
    qkv = "model.layers.0.self_attn.qkv_proj.weight"
    assert stores[0][qkv].shape == (1 * 2 + 2 * 2, 4)  # one q head, one (replicated) k head, one v head
    k = full["model.layers.0.self_attn.k_proj.weight"]
    assert torch.equal(stores[0][qkv][2:4], k[0:2]) and torch.equal(stores[1][qkv][2:4], k[0:2])
    assert torch.equal(stores[2][qkv][2:4], k[2:4]) and torch.equal(stores[3][qkv][2:4], k[2:4])
    assert torch.equal(assemble(specs, stores, engine)["model.layers.0.self_attn.k_proj.weight"], k)


def test_bad_shapes_and_names_are_named():
    specs = qwen2_specs(hidden=4, heads=2, kv=2, hd=2, ffn=8, vocab=16, trainer_padded_vocab=16)
    engine = EngineSpec("e", 2, vocab_pad_to=1)
    stores = make_stores(specs, full_tensors(specs, 1), engine)
    spec = specs[1]
    with pytest.raises(PlanError, match="q_proj.weight: received shard of shape"):
        place_shard(stores[0], spec, engine, torch.zeros(3, 4))
    with pytest.raises(PlanError, match="unknown parameter names"):
        assemble(specs, stores, engine, ["nope"])
