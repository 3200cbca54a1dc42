"""Reshard plan: every engine rank's shard, rebuilt from Megatron shards, equals SGLang's own slicing.

The references here are written independently of `plan.py`: Megatron shards are made the way
Megatron lays out fused tensors, engine shards the way SGLang 0.5.10's weight loaders narrow full
HF tensors (linear.py QKVParallelLinear / MergedColumnParallelLinear / RowParallelLinear,
vocab_parallel_embedding.py).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from miles_lite.weight_sync.plan import (
    EngineSpec,
    ParamSpec,
    PlanError,
    apply_plan,
    apply_rank_plan,
    build_plan,
    full_tensor_plan,
    fused_offset,
    source_shapes,
)


def qwen2_specs(hidden: int, heads: int, kv: int, hd: int, ffn: int, vocab: int, trainer_padded_vocab: int,
                layers: int = 1, tied: bool = False) -> list[ParamSpec]:
    specs = [ParamSpec("model.embed_tokens.weight", (vocab, hidden), kind="vocab", source="embedding",
                       trainer_padded_vocab=trainer_padded_vocab)]
    for i in range(layers):
        p = f"model.layers.{i}."
        qkv = f"decoder.layers.{i}.linear_qkv"
        for role, n in (("q", heads), ("k", kv), ("v", kv)):
            geo = dict(kind="qkv", role=role, num_heads=heads, num_kv_heads=kv, head_dim=hd)
            specs.append(ParamSpec(f"{p}self_attn.{role}_proj.weight", (n * hd, hidden), source=f"{qkv}.weight", **geo))
            specs.append(ParamSpec(f"{p}self_attn.{role}_proj.bias", (n * hd,), source=f"{qkv}.bias", **geo))
        specs += [
            ParamSpec(f"{p}self_attn.o_proj.weight", (hidden, heads * hd), kind="row"),
            ParamSpec(f"{p}mlp.gate_proj.weight", (ffn, hidden), kind="gate_up", role="gate", source=f"fc1.{i}"),
            ParamSpec(f"{p}mlp.up_proj.weight", (ffn, hidden), kind="gate_up", role="up", source=f"fc1.{i}"),
            ParamSpec(f"{p}mlp.down_proj.weight", (hidden, ffn), kind="row"),
            ParamSpec(f"{p}input_layernorm.weight", (hidden,)),
            ParamSpec(f"{p}post_attention_layernorm.weight", (hidden,)),
        ]
    specs.append(ParamSpec("model.norm.weight", (hidden,)))
    if not tied:
        specs.append(ParamSpec("lm_head.weight", (vocab, hidden), kind="vocab", source="output_layer",
                               trainer_padded_vocab=trainer_padded_vocab))
    return specs


def full_tensors(specs: list[ParamSpec], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {s.name: torch.randn(s.shape, generator=g) for s in specs}


def megatron_shards(specs: list[ParamSpec], full: dict[str, torch.Tensor], tp: int) -> list[dict[str, torch.Tensor]]:
    """Megatron's local tensors at TP `tp`, built from full HF tensors the way HF->Megatron converters do."""
    shards: list[dict[str, torch.Tensor]] = [{} for _ in range(tp)]
    by_source: dict[str, dict[str, ParamSpec]] = {}
    for s in specs:
        by_source.setdefault(s.source, {})[s.role or s.kind] = s
    for source, group in by_source.items():
        first = next(iter(group.values()))
        if first.kind == "qkv":
            q, k, v = (full[group[r].name] for r in ("q", "k", "v"))
            ng, hd = first.num_kv_heads, first.head_dim
            rest = q.shape[1:]
            fused = torch.cat([q.reshape(ng, -1, hd, *rest), k.reshape(ng, 1, hd, *rest),
                               v.reshape(ng, 1, hd, *rest)], dim=1).reshape(-1, *rest)
            parts = fused.chunk(tp, dim=0)
        elif first.kind == "gate_up":
            gate, up = full[group["gate"].name].chunk(tp), full[group["up"].name].chunk(tp)
            parts = [torch.cat([gate[r], up[r]]) for r in range(tp)]
        elif first.kind == "vocab":
            t = full[first.name]
            pad = torch.full((first.trainer_padded_vocab - t.shape[0], *t.shape[1:]), float("nan"))
            parts = torch.cat([t, pad]).chunk(tp)
        elif first.kind in ("column", "row"):
            parts = full[first.name].chunk(tp, dim=first.dim)
        else:
            parts = [full[first.name]] * tp
        for r in range(tp):
            shards[r][source] = parts[r].clone()
    return shards


def sglang_shard(spec: ParamSpec, full: torch.Tensor, tp: int, rank: int, pad_to: int = 64) -> torch.Tensor:
    """What SGLang's weight loader leaves in engine rank `rank` for this HF tensor."""
    if spec.kind == "qkv":
        if spec.role == "q":
            size = spec.num_heads // tp * spec.head_dim
            return full.narrow(0, rank * size, size)
        if tp >= spec.num_kv_heads:
            num_kv, replicas = 1, tp // spec.num_kv_heads
        else:
            num_kv, replicas = spec.num_kv_heads // tp, 1
        size = num_kv * spec.head_dim
        return full.narrow(0, (rank // replicas) * size, size)
    if spec.kind in ("column", "gate_up"):
        size = full.shape[0] // tp
        return full.narrow(0, rank * size, size)
    if spec.kind == "row":
        size = full.shape[1] // tp
        return full.narrow(1, rank * size, size)
    if spec.kind == "vocab":
        padded = (full.shape[0] + pad_to - 1) // pad_to * pad_to
        per = padded // tp
        start, end = min(rank * per, full.shape[0]), min((rank + 1) * per, full.shape[0])
        out = torch.zeros(per, *full.shape[1:])
        out[: end - start] = full[start:end]
        return out
    return full


@st.composite
def geometries(draw):
    kv = draw(st.sampled_from([1, 2, 4]))
    heads = kv * draw(st.sampled_from([1, 2, 3, 4]))
    trainer_tp = draw(st.sampled_from([d for d in (1, 2, 4) if kv % d == 0]))
    engine_tps = [d for d in (1, 2, 4, 8) if heads % d == 0 and (kv % d == 0 or d % kv == 0)]
    engines = draw(st.lists(st.sampled_from(engine_tps), min_size=1, max_size=3))
    hd = draw(st.sampled_from([1, 2, 4]))
    hidden = draw(st.integers(1, 6))
    ffn = 24 * draw(st.integers(1, 2))
    vocab = draw(st.integers(1, 200))
    pad_to = draw(st.sampled_from([8, 64]))
    tmult = 4 * trainer_tp
    return dict(kv=kv, heads=heads, trainer_tp=trainer_tp, engines=engines, hd=hd, hidden=hidden, ffn=ffn,
                vocab=vocab, trainer_padded_vocab=(vocab + tmult - 1) // tmult * tmult, pad_to=pad_to,
                seed=draw(st.integers(0, 2**16)))


@settings(max_examples=60, deadline=None)
@given(geometries())
def test_apply_plan_matches_sglang_slicing(g):
    specs = qwen2_specs(g["hidden"], g["heads"], g["kv"], g["hd"], g["ffn"], g["vocab"], g["trainer_padded_vocab"])
    full = full_tensors(specs, g["seed"])
    engines = [EngineSpec(f"e{i}", tp, vocab_pad_to=g["pad_to"]) for i, tp in enumerate(g["engines"])]
    plan = build_plan(specs, g["trainer_tp"], engines)
    shards = megatron_shards(specs, full, g["trainer_tp"])
    assert {k: tuple(v.shape) for k, v in shards[0].items()} == source_shapes(specs, g["trainer_tp"])
    out = apply_plan(plan, shards)
    for engine in engines:
        assert len(out[engine.engine_id]) == engine.tp
        for rank, got in enumerate(out[engine.engine_id]):
            for spec in specs:
                want = sglang_shard(spec, full[spec.name], engine.tp, rank, g["pad_to"])
                assert torch.equal(got[spec.name], want), (spec.name, engine.tp, rank)
    # The full-tensor plan (broadcast / disk path) rebuilds the HF checkpoint exactly.
    rebuilt = apply_rank_plan(full_tensor_plan(specs, g["trainer_tp"]), shards)
    assert all(torch.equal(rebuilt[s.name], full[s.name]) for s in specs)


@settings(max_examples=30, deadline=None)
@given(geometries())
def test_equal_tp_takes_one_trainer_shard_without_gather(g):
    specs = qwen2_specs(g["hidden"], g["heads"], g["kv"], g["hd"], g["ffn"], g["vocab"], g["trainer_padded_vocab"])
    tp = g["trainer_tp"]
    plan = build_plan(specs, tp, [EngineSpec("same", tp, vocab_pad_to=g["pad_to"])])
    for rank_plan in plan.ranks[0]:
        sources = {t.src_rank for s in rank_plan.shards for t in s.transfers if s.name.endswith(("proj.weight",))}
        assert sources <= {rank_plan.rank}


def test_trainer_tp_above_engine_tp_gathers_and_replicates_kv_heads():
    specs = qwen2_specs(hidden=4, heads=8, kv=2, hd=2, ffn=8, vocab=10, trainer_padded_vocab=16)
    plan = build_plan(specs, trainer_tp=2, engines=[EngineSpec("one", 1), EngineSpec("eight", 8)])
    q = next(s for s in plan.ranks[0][0].shards if s.name.endswith("q_proj.weight"))
    assert {t.src_rank for t in q.transfers} == {0, 1}  # gathered from both trainer ranks
    # TP=8 > 2 KV heads: ranks 0..3 hold KV head 0, ranks 4..7 KV head 1 (from trainer rank 1).
    for rank_plan in plan.ranks[1]:
        k = next(s for s in rank_plan.shards if s.name.endswith("k_proj.weight"))
        assert k.shape == (2, 4)
        assert [t.src_rank for t in k.transfers] == [rank_plan.rank // 4]


def test_fused_offsets_follow_sglang_qkv_and_gate_up_layout():
    specs = {s.name: s for s in qwen2_specs(hidden=4, heads=8, kv=2, hd=3, ffn=8, vocab=10, trainer_padded_vocab=16)}
    q, k, v = (specs[f"model.layers.0.self_attn.{r}_proj.weight"] for r in "qkv")
    assert [fused_offset(s, 2) for s in (q, k, v)] == [0, 12, 15]
    assert [fused_offset(s, 4) for s in (q, k, v)] == [0, 6, 9]  # one replicated KV head per rank
    assert fused_offset(specs["model.layers.0.mlp.up_proj.weight"], 2) == 4


def test_bytes_and_shapes_are_reported_per_rank():
    specs = qwen2_specs(hidden=4, heads=4, kv=2, hd=2, ffn=8, vocab=100, trainer_padded_vocab=104)
    plan = build_plan(specs, 1, [EngineSpec("e", 2, vocab_pad_to=64)])
    embed = plan.ranks[0][1].shards[0]
    assert embed.shape == (64, 4)  # 100 -> 128 padded, 64 rows per rank
    assert sum(t.length for t in embed.transfers) == 36  # real rows 64..99 only
    assert plan.ranks[0][0].nbytes == sum(s.nbytes for s in plan.ranks[0][0].shards)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(kind="diagonal"), "kind="),
        (dict(kind="qkv", role="x", num_heads=2, num_kv_heads=1, head_dim=2), "role="),
        (dict(kind="qkv", role="q", num_heads=3, num_kv_heads=2, head_dim=2), "num_kv_heads=2"),
        (dict(dtype="int3"), "dtype="),
        (dict(kind="row", shape=(4,)), "kind='replicated'"),
    ],
)
def test_bad_specs_name_the_field(kwargs, field):
    args = dict(name="w", shape=(4, 4)) | kwargs
    with pytest.raises(PlanError, match=field):
        ParamSpec(**args)


def test_indivisible_tp_names_the_tensor():
    specs = qwen2_specs(hidden=4, heads=6, kv=2, hd=2, ffn=8, vocab=10, trainer_padded_vocab=16)
    with pytest.raises(PlanError, match="q_proj.weight.*tp=4"):
        build_plan(specs, 1, [EngineSpec("e", 4)])
    with pytest.raises(PlanError, match="query groups"):
        build_plan(specs, 4, [EngineSpec("e", 1)])
    with pytest.raises(PlanError, match="duplicate ParamSpec"):
        build_plan(specs + specs[:1], 1, [EngineSpec("e", 1)])
