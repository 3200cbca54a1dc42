"""Weight-update request bodies against SGLang's io_struct.py request structs (0.5.10, 0.5.17, 0.5.23).

SGLang builds each request as `Cls(**body)`: every required field must be present and no other
key may appear. The field lists below are read off each release's `python/sglang/srt/managers/io_struct.py`
(dataclasses in 0.5.10.post1, msgspec structs later; BaseReq's keyword-only `rid`/`http_worker_ipc` omitted).
"""

from __future__ import annotations

import json

import pytest
import torch

from miles_lite.weight_sync import sglang_payloads as p

# class name -> (required fields, optional fields)
IO_STRUCT_0_5_10 = {
    "InitWeightsUpdateGroupReqInput": (
        {"master_address", "master_port", "rank_offset", "world_size"}, {"group_name", "backend"}),
    "DestroyWeightsUpdateGroupReqInput": (set(), {"group_name"}),
    "UpdateWeightsFromDistributedReqInput": (
        {"names", "dtypes", "shapes"},
        {"group_name", "flush_cache", "abort_all_requests", "weight_version", "load_format"}),
    "UpdateWeightsFromTensorReqInput": (
        {"serialized_named_tensors"},
        {"load_format", "flush_cache", "abort_all_requests", "weight_version", "disable_draft_model"}),
    "UpdateWeightFromDiskReqInput": (
        {"model_path"},
        {"load_format", "abort_all_requests", "weight_version", "is_async", "torch_empty_cache", "keep_pause",
         "recapture_cuda_graph", "token_step", "flush_cache", "manifest"}),
    "UpdateWeightVersionReqInput": ({"new_version"}, {"abort_all_requests"}),
    "GetWeightsByNameReqInput": ({"name"}, {"truncate_size"}),
    "PauseGenerationReqInput": (set(), {"mode"}),
    "ContinueGenerationReqInput": (set(), set()),
    "CheckWeightsReqInput": ({"action"}, set()),
}
# 0.5.23: `selector` / `torch_empty_cache` added, `disable_draft_model` gone, `action` optional.
IO_STRUCT_0_5_23 = {
    **IO_STRUCT_0_5_10,
    "UpdateWeightsFromDistributedReqInput": (
        {"names", "dtypes", "shapes"},
        {"group_name", "flush_cache", "abort_all_requests", "weight_version", "load_format", "selector",
         "torch_empty_cache"}),
    "UpdateWeightsFromTensorReqInput": (
        {"serialized_named_tensors"},
        {"load_format", "flush_cache", "abort_all_requests", "weight_version", "selector", "torch_empty_cache"}),
    "ContinueGenerationReqInput": (set(), {"torch_empty_cache"}),
    "CheckWeightsReqInput": (set(), {"action", "allow_quant_error", "selector", "skip_tensor_list"}),
}
# 0.5.17: `torch_empty_cache` added where 0.5.23 has it, `disable_draft_model` kept, `action` optional.
IO_STRUCT_0_5_17 = {
    **IO_STRUCT_0_5_10,
    "UpdateWeightsFromDistributedReqInput": (
        {"names", "dtypes", "shapes"},
        {"group_name", "flush_cache", "abort_all_requests", "weight_version", "load_format", "torch_empty_cache"}),
    "UpdateWeightsFromTensorReqInput": (
        {"serialized_named_tensors"},
        {"load_format", "flush_cache", "abort_all_requests", "weight_version", "disable_draft_model",
         "torch_empty_cache"}),
    "ContinueGenerationReqInput": (set(), {"torch_empty_cache"}),
    "CheckWeightsReqInput": (set(), {"action", "allow_quant_error"}),
}
IO_STRUCTS = {"0.5.10": IO_STRUCT_0_5_10, "0.5.17": IO_STRUCT_0_5_17, "0.5.23": IO_STRUCT_0_5_23}


def check_fields(request: p.SGLangRequest, cls: str) -> dict:
    """The request's body, valid for `cls` on every SGLang version the project runs on."""
    body = json.loads(json.dumps(request.body))  # must be plain JSON
    for version, structs in IO_STRUCTS.items():
        required, optional = structs[cls]
        assert required <= body.keys(), f"{cls} ({version}): missing {required - body.keys()}"
        assert body.keys() <= required | optional, f"{cls} ({version}): unknown {body.keys() - required - optional}"
    return body


def test_init_and_destroy_group():
    req = p.init_weights_update_group("127.0.0.1", 29500, 2, 6, "wsync", "gloo")
    assert (req.method, req.path) == ("POST", "/init_weights_update_group")
    body = check_fields(req, "InitWeightsUpdateGroupReqInput")
    assert body == {"master_address": "127.0.0.1", "master_port": 29500, "rank_offset": 2, "world_size": 6,
                    "group_name": "wsync", "backend": "gloo"}
    assert check_fields(p.destroy_weights_update_group("wsync"), "DestroyWeightsUpdateGroupReqInput") == {
        "group_name": "wsync"}


def test_update_from_distributed_normalises_dtypes_and_shapes():
    req = p.update_weights_from_distributed(["a", "b"], [torch.bfloat16, "float32"], [torch.Size([2, 3]), (4,)],
                                            "g", weight_version=7, load_format=p.FLATTENED_BUCKET)
    body = check_fields(req, "UpdateWeightsFromDistributedReqInput")
    assert body["dtypes"] == ["bfloat16", "float32"]
    assert body["shapes"] == [[2, 3], [4]]
    assert body["weight_version"] == "7" and body["load_format"] == "flattened_bucket"
    assert "load_format" not in p.update_weights_from_distributed(["a"], ["float32"], [[1]], "g").body


def test_update_from_tensor_disk_version_weights_pause():
    body = check_fields(p.update_weights_from_tensor(["AAA", "BBB"], load_format="direct", weight_version="3"),
                        "UpdateWeightsFromTensorReqInput")
    assert body["serialized_named_tensors"] == ["AAA", "BBB"]
    body = check_fields(p.update_weights_from_disk("/ckpt/v3", weight_version="3"), "UpdateWeightFromDiskReqInput")
    assert body == {"model_path": "/ckpt/v3", "flush_cache": True, "weight_version": "3"}
    assert check_fields(p.update_weight_version("3"), "UpdateWeightVersionReqInput")["abort_all_requests"] is False
    assert check_fields(p.get_weights_by_name("lm_head.weight", 5), "GetWeightsByNameReqInput")["truncate_size"] == 5
    assert check_fields(p.pause_generation(), "PauseGenerationReqInput") == {"mode": "retract"}
    check_fields(p.continue_generation(), "ContinueGenerationReqInput")
    check_fields(p.weights_checker("compare"), "CheckWeightsReqInput")
    assert p.flush_cache().body is None and p.model_info().method == "GET"


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: p.init_weights_update_group("h", 1, 0, 3, "g", "gloo"), "rank_offset"),
        (lambda: p.init_weights_update_group("h", 1, 1, 3, "g", "mpi"), "backend"),
        (lambda: p.update_weights_from_distributed(["a"], ["float32"], [], "g"), "equally long"),
        (lambda: p.update_weights_from_distributed(["a"], ["floaty"], [[1]], "g"), "torch dtype"),
        (lambda: p.update_weights_from_distributed(["a"], ["float32"], [[1]], "g", load_format="x"), "load_format"),
        (lambda: p.update_weights_from_tensor([]), "one base64 string"),
        (lambda: p.update_weights_from_disk(""), "model_path"),
        (lambda: p.pause_generation("stop"), "mode"),
        (lambda: p.weights_checker("scramble"), "action"),
    ],
)
def test_bad_arguments_name_the_field(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_fields_match_installed_sglang_when_present():
    io_struct = pytest.importorskip("sglang.srt.managers.io_struct")
    import dataclasses
    from importlib.metadata import version

    installed = version("sglang")
    known = next((structs for v, structs in IO_STRUCTS.items() if installed.startswith(v)), None)
    if known is None:
        pytest.skip(f"fields recorded for SGLang {sorted(IO_STRUCTS)}, installed {installed}")
    for cls, (required, optional) in known.items():
        struct = getattr(io_struct, cls)
        if dataclasses.is_dataclass(struct):
            names = {f.name for f in dataclasses.fields(struct)}
        else:  # later releases declare requests as msgspec structs
            import msgspec

            names = {f.name for f in msgspec.structs.fields(struct)}
        assert names - {"rid", "http_worker_ipc"} == required | optional, cls


def test_ipc_direct_payload_fuses_each_rank_like_sglang_parameters():
    import base64
    import pickle

    import torch.multiprocessing  # noqa: F401  (registers the tensor reductions ForkingPickler uses)
    from test_plan import full_tensors, megatron_shards, qwen2_specs, sglang_shard

    from miles_lite.weight_sync.ipc import direct_named_tensors, serialize_named_tensors, sglang_param_name
    from miles_lite.weight_sync.plan import EngineSpec, apply_rank_plan, build_plan

    specs = qwen2_specs(hidden=4, heads=4, kv=1, hd=2, ffn=8, vocab=70, trainer_padded_vocab=72)
    full = full_tensors(specs, seed=5)
    plan = build_plan(specs, 1, [EngineSpec("e", 2, vocab_pad_to=64)])
    rank_plan = plan.ranks[0][1]
    named = direct_named_tensors(rank_plan, specs, apply_rank_plan(rank_plan, megatron_shards(specs, full, 1)))
    got = dict(named)
    by = {s.name: s for s in specs}
    p = "model.layers.0."
    want_qkv = torch.cat([sglang_shard(by[f"{p}self_attn.{r}_proj.weight"], full[f"{p}self_attn.{r}_proj.weight"], 2, 1)
                          for r in "qkv"])
    assert torch.equal(got[f"{p}self_attn.qkv_proj.weight"], want_qkv)  # KV head replicated on both ranks
    want_gate_up = torch.cat([full[f"{p}mlp.gate_proj.weight"][4:], full[f"{p}mlp.up_proj.weight"][4:]])
    assert torch.equal(got[f"{p}mlp.gate_up_proj.weight"], want_gate_up)
    assert got["model.embed_tokens.weight"].shape == (64, 4)  # 70 -> 128 padded rows, 64 per rank
    assert sglang_param_name(f"{p}self_attn.o_proj.weight") == f"{p}self_attn.o_proj.weight"
    decoded = pickle.loads(base64.b64decode(serialize_named_tensors(named)))
    assert [n for n, _ in decoded] == [n for n, _ in named]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(decoded, named, strict=True))
