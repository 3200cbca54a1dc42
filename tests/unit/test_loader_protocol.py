"""The SGLang weight-loader plugin's requests and byte layout, without a process group.

What the trainer ranks pack (`pack_sends`) for one engine rank, written by the plugin's `write_blocks`
into that rank's SGLang-laid-out parameters (fused qkv / gate_up, padded vocab), must give exactly the
rank's store of the new weights (`make_stores`, written from SGLang's loaders), over random
geometries; the request must survive the wire encoding SGLang decodes; a model that does not fit
is refused before any group is joined.
"""

from __future__ import annotations

import importlib
import pickletools

import pytest
import torch
from hypothesis import given, settings
from test_plan import full_tensors, geometries, megatron_shards, qwen2_specs

from miles_lite.engines.sglang.weight_loader import (
    RECEIVER_ATTR,
    ReceiverState,
    buffer_sizes,
    load_pushed_weights,
    write_blocks,
)
from miles_lite.weight_sync.buckets import shard_buckets
from miles_lite.weight_sync.engine_layout import make_stores
from miles_lite.weight_sync.loader_protocol import (
    LOADER_FUNCTION,
    deserialize,
    from_named_tensors,
    join_request,
    leave_request,
    rank_params,
    receive_request,
    serialize,
    to_named_tensors,
)
from miles_lite.weight_sync.plan import EngineSpec, build_plan
from miles_lite.weight_sync.shard_protocol import bucket_schedules, pack_sends


class StoreModel:
    """What the plugin sees of SGLang's model: `named_parameters()` in SGLang's names and layout."""

    def __init__(self, store: dict[str, torch.Tensor]) -> None:
        self.params = {n: torch.nn.Parameter(t.clone(), requires_grad=False) for n, t in store.items()}

    def named_parameters(self):
        return iter(self.params.items())


@settings(max_examples=40, deadline=None)
@given(geometries())
def test_packed_blocks_written_by_the_plugin_give_each_ranks_shards(g):
    specs = qwen2_specs(g["hidden"], g["heads"], g["kv"], g["hd"], g["ffn"], g["vocab"], g["trainer_padded_vocab"],
                        tied=g["seed"] % 2 == 0)
    old, new = full_tensors(specs, g["seed"]), full_tensors(specs, g["seed"] + 1)
    trainer = megatron_shards(specs, new, g["trainer_tp"])
    engines = [EngineSpec(f"e{i}", tp, vocab_pad_to=g["pad_to"]) for i, tp in enumerate(g["engines"])]
    plan = build_plan(specs, g["trainer_tp"], engines)
    by_name = {s.name: s for s in specs}
    buckets = shard_buckets(plan, 1 << 10)
    for engine, rank_plans in zip(engines, plan.ranks, strict=True):
        expected = make_stores(specs, new, engine)
        for rp, old_store, new_store in zip(rank_plans, make_stores(specs, old, engine), expected, strict=True):
            model = StoreModel(old_store)
            params = dict(model.named_parameters())
            pointers = {n: p.data_ptr() for n, p in params.items()}
            dst = g["trainer_tp"]  # the engine rank's group rank, after the trainer ranks
            loaded = []
            for bucket in buckets:
                request = from_named_tensors(deserialize(serialize(
                    receive_request("g", bucket, rp, by_name, engine))))
                schedules = bucket_schedules(bucket, [(dst, rp)], g["trainer_tp"])
                buffers = {src: flat for src, sched in enumerate(schedules)
                           for peer_dst, flat in pack_sends(trainer[src], sched) if peer_dst == dst}
                assert {s: b.numel() for s, b in buffers.items()} == buffer_sizes(request)
                loaded += write_blocks(params, request, buffers)
            assert loaded == [s.name for s in specs]
            for name, tensor in new_store.items():
                assert torch.equal(params[name], tensor), (engine.tp, rp.rank, name)
                assert params[name].data_ptr() == pointers[name]  # in place, as SGLang's CUDA graphs need


def test_request_travels_as_plain_bytes_and_names_the_loader():
    request = join_request("grp", "nccl", "10.0.0.7", 29500, 3, 5, 60.0, {"a.weight": (4, 2)})
    payload = serialize(request)
    ops = {str(arg) for _, arg, _ in pickletools.genops(__import__("base64").b64decode(payload)) if arg is not None}
    # An empty tensor pickles without shared memory or file descriptors: valid on another host.
    assert not any("fd" in op.lower() or "filename" in op.lower() or "shared" in op.lower() for op in ops), ops
    back = from_named_tensors(deserialize(payload))
    assert back == request and back.fields["params"] == {"a.weight": [4, 2]}
    module, _, fn = LOADER_FUNCTION.rpartition(".")
    assert getattr(importlib.import_module(module), fn) is load_pushed_weights


def test_foreign_payloads_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="load_format=None"):
        from_named_tensors([("model.embed_tokens.weight", torch.zeros(2))])
    bad = to_named_tensors(leave_request("g"))[0][0].replace('"leave"', '"explode"')
    with pytest.raises(ValueError, match="explode"):
        from_named_tensors([(bad, torch.empty(0))])


def test_join_refuses_a_model_that_does_not_fit_before_joining():
    specs = qwen2_specs(8, 4, 2, 2, 24, 50, 56, tied=True)
    engine = EngineSpec("e", 2, vocab_pad_to=64)
    store = make_stores(specs, full_tensors(specs, 0), engine)[1]
    name = "model.layers.0.self_attn.qkv_proj.weight"
    store[name] = torch.zeros(store[name].shape[0] + 2, store[name].shape[1])  # an engine with another geometry
    model = StoreModel(store)
    # Port 1 is never listened on: reaching the rendezvous would fail differently.
    join = join_request("g", "gloo", "127.0.0.1", 1, 2, 4, 1.0, rank_params(specs, engine, 1))
    with pytest.raises(ValueError, match="qkv_proj.weight: shape"):
        load_pushed_weights(model, to_named_tensors(join))
    assert getattr(model, RECEIVER_ATTR).state is ReceiverState.IDLE
    with pytest.raises(RuntimeError, match="joins it first"):
        load_pushed_weights(model, to_named_tensors(receive_request(
            "g", shard_buckets(build_plan(specs, 1, [engine]), 1 << 20)[0], build_plan(specs, 1, [engine]).ranks[0][1],
            {s.name: s for s in specs}, engine)))
    assert load_pushed_weights(model, to_named_tensors(leave_request("g"))) == []
