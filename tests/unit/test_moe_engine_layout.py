"""Routed experts on the engine side, laid out as SGLang's `FusedMoE` holds them: `experts.w13_weight`
[experts, [gate; up] of the rank, hidden] and `experts.w2_weight` [experts, hidden, the rank's down_proj columns].

The expected tensors are written from SGLang's MoE loader rules (w1 = gate in the first half of an expert's
w13 rows, w3 = up in the second, each the rank's `chunk` of the intermediate dimension; w2 the rank's chunk
of down_proj's input columns). Every push path that writes SGLang's parameters directly must produce them:
the weight-loader plugin (blocks sent by the trainer's TP and expert-parallel senders) and the `direct`
tensors of the CUDA-IPC transports.
"""

from __future__ import annotations

import pytest
import torch
from test_loader_protocol import StoreModel
from test_moe_plan import GRIDS, SHAPE, VOCAB, megatron_shapes, model  # noqa: F401  (model: a fixture)

from miles_lite.cluster.rank import expert_senders, weight_senders
from miles_lite.engines.sglang.weight_loader import write_blocks
from miles_lite.trainer.hf_convert import expert_on_rank, layout_for
from miles_lite.trainer.model import padded_vocab_size
from miles_lite.weight_sync.buckets import shard_buckets
from miles_lite.weight_sync.engine_layout import assemble, expert_slot, make_stores, sglang_param_name, store_shapes
from miles_lite.weight_sync.ipc import direct_named_tensors
from miles_lite.weight_sync.layouts import specs_from_layouts
from miles_lite.weight_sync.loader_protocol import receive_request
from miles_lite.weight_sync.plan import EngineSpec, apply_rank_plan, build_plan
from miles_lite.weight_sync.shard_protocol import bucket_schedules, pack_sends
from miles_lite.weight_sync.transport import WeightSyncError

LAYER = "model.layers.1.mlp.experts"  # layer 0 is dense (mlp_only_layers=[0])
E, H, F = SHAPE.num_experts, SHAPE.hidden_size, SHAPE.moe_ffn_hidden_size


def sglang_fused_moe(hf: dict[str, torch.Tensor], tp: int, rank: int) -> dict[str, torch.Tensor]:
    """Engine rank `rank`'s w13 / w2 of layer 1, as SGLang's FusedMoE loader fills them."""
    w13 = torch.stack([torch.cat([hf[f"{LAYER}.{e}.gate_proj.weight"].chunk(tp)[rank],
                                  hf[f"{LAYER}.{e}.up_proj.weight"].chunk(tp)[rank]]) for e in range(E)])
    w2 = torch.stack([hf[f"{LAYER}.{e}.down_proj.weight"].chunk(tp, dim=1)[rank] for e in range(E)])
    return {f"{LAYER}.w13_weight": w13, f"{LAYER}.w2_weight": w2}


def trainer_side(hf: dict[str, torch.Tensor], spec, grid: str):
    """(specs, each sender's Megatron shards) of a trainer on `grid` holding the weights `hf`."""
    tp, coords, ep = GRIDS[grid]
    padded = padded_vocab_size(VOCAB, tp, 4)
    rank_layouts = {c.rank: {n: layout_for(n, s, spec, c.tp_rank, tp, padded, c.ep_rank, ep)
                             for n, s in megatron_shapes(spec, tp, ep, padded).items()} for c in coords}
    senders = weight_senders(coords, tp)
    layouts = [expanded for lay in rank_layouts[0].values()
               for expanded in ([lay] if lay.expert is None else
                                [expert_on_rank(lay, r, ep, spec.num_experts) for r in range(ep)])]
    specs = specs_from_layouts(layouts, "float32", expert_senders(coords, senders, ep, spec.num_experts))
    shards = [{n: lay.assemble(hf) for n, lay in rank_layouts[rank].items() if i < tp or lay.expert is not None}
              for i, rank in enumerate(senders)]
    return specs, shards


def test_expert_names_map_onto_the_stacked_parameters() -> None:
    assert expert_slot(f"{LAYER}.5.up_proj.weight") == (f"{LAYER}.w13_weight", 5)
    assert sglang_param_name(f"{LAYER}.5.gate_proj.weight") == f"{LAYER}.w13_weight"
    assert sglang_param_name(f"{LAYER}.12.down_proj.weight") == f"{LAYER}.w2_weight"
    # The router and the dense MLP keep their own parameters.
    assert expert_slot("model.layers.1.mlp.gate.weight") is None
    assert sglang_param_name("model.layers.0.mlp.gate_proj.weight") == "model.layers.0.mlp.gate_up_proj.weight"


@pytest.mark.parametrize("engine_tp", [1, 2])
def test_engine_store_holds_experts_as_sglang_fused_moe(model, engine_tp: int) -> None:  # noqa: F811
    hf, spec = model
    specs, _ = trainer_side(hf, spec, "tp2")
    engine = EngineSpec("e", engine_tp, vocab_pad_to=8)
    stores = make_stores(specs, hf, engine)
    for rank, store in enumerate(stores):
        shapes = store_shapes(specs, engine, rank)
        assert shapes[f"{LAYER}.w13_weight"] == (E, 2 * F // engine_tp, H)
        assert shapes[f"{LAYER}.w2_weight"] == (E, H, F // engine_tp)
        assert not [n for n in shapes if ".experts." in n and not n.endswith(("w13_weight", "w2_weight"))]
        for name, want in sglang_fused_moe(hf, engine_tp, rank).items():
            assert torch.equal(store[name], want), (rank, name)
    back = assemble(specs, stores, engine)
    assert all(torch.equal(back[n], hf[n]) for n in hf)


@pytest.mark.parametrize("grid", sorted(GRIDS))
def test_plugin_push_from_tp_and_ep_senders_writes_sglang_fused_moe(model, grid: str) -> None:  # noqa: F811
    hf, spec = model
    new = {n: t + 1.0 for n, t in hf.items()}
    specs, shards = trainer_side(new, spec, grid)
    engine = EngineSpec("e", 2, vocab_pad_to=8)
    plan = build_plan(specs, GRIDS[grid][0], [engine])
    by_name = {s.name: s for s in specs}
    senders = len(shards)
    for rp, old_store, new_store in zip(plan.ranks[0], make_stores(specs, hf, engine), make_stores(specs, new, engine),
                                        strict=True):
        params = dict(StoreModel(old_store).named_parameters())
        pointers = {n: p.data_ptr() for n, p in params.items()}
        for bucket in shard_buckets(plan, 1 << 11):  # small buckets: a layer's experts span several
            request = receive_request("g", bucket, rp, by_name, engine)
            schedules = bucket_schedules(bucket, [(senders, rp)], senders)
            buffers = {src: flat for src, sched in enumerate(schedules)
                       for dst, flat in pack_sends(shards[src], sched) if dst == senders}
            write_blocks(params, request, buffers)
        for name, tensor in new_store.items():
            assert torch.equal(params[name], tensor), (rp.rank, name)
            assert params[name].data_ptr() == pointers[name]  # in place
        for name, want in sglang_fused_moe(new, 2, rp.rank).items():
            assert torch.equal(params[name], want), (rp.rank, name)


def test_direct_tensors_stack_every_expert_of_a_layer(model) -> None:  # noqa: F811
    hf, spec = model
    specs, shards = trainer_side(hf, spec, "ep2_tp2")
    engine = EngineSpec("e", 2, vocab_pad_to=8)
    plan = build_plan(specs, 2, [engine])
    for rp in plan.ranks[0]:
        local = apply_rank_plan(rp, shards)
        got = dict(direct_named_tensors(rp, specs, local))
        for name, want in sglang_fused_moe(hf, 2, rp.rank).items():
            assert torch.equal(got[name], want), (rp.rank, name)
        # A layer's experts split over two buckets cannot become one stacked parameter.
        partial = {n: t for n, t in local.items() if f"{LAYER}.3." not in n}
        with pytest.raises(WeightSyncError, match=r"experts \[3\]"):
            direct_named_tensors(rp, specs, partial)
