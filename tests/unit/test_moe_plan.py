"""The reshard plan for a Qwen3-MoE trainer with tensor and expert parallelism: dense tensors resharded from the
TP ranks, every routed expert taken whole from a sender on its expert-parallel rank."""

from __future__ import annotations

import pytest
import torch

from miles_lite.cluster.rank import RankCoords, expert_senders, weight_senders
from miles_lite.config.schema import TinyModelShape
from miles_lite.trainer.hf_convert import expert_on_rank, layout_for
from miles_lite.trainer.model import padded_vocab_size, spec_from_hf_config
from miles_lite.trainer.tiny_hf import build_tiny_hf_model, checkpoint_state
from miles_lite.weight_sync.layouts import specs_from_layouts
from miles_lite.weight_sync.plan import (
    EngineSpec,
    ParamSpec,
    PlanError,
    apply_plan,
    apply_rank_plan,
    build_plan,
    full_tensor_plan,
    sender_count,
    source_shapes,
)

SHAPE = TinyModelShape(hidden_size=16, ffn_hidden_size=24, num_layers=2, num_attention_heads=4, num_kv_heads=2,
                       head_dim=4, tie_word_embeddings=False, qkv_bias=False, qk_norm=True, num_experts=4,
                       num_experts_per_tok=2, moe_ffn_hidden_size=8, mlp_only_layers=[0])
VOCAB = 40


@pytest.fixture(scope="module")
def model() -> tuple[dict[str, torch.Tensor], object]:
    hf_model = build_tiny_hf_model("qwen3_moe", SHAPE, VOCAB, seed=3)
    return {n: t.detach().clone() for n, t in checkpoint_state(hf_model).items()}, spec_from_hf_config(hf_model.config)


def megatron_shapes(spec, tp: int, ep: int, padded: int) -> dict[str, tuple[int, ...]]:
    """Local-spec Megatron parameters of one rank (TP `tp`, `num_experts / ep` local experts)."""
    h, hd, f = spec.hidden_size, spec.head_dim, spec.moe_ffn_hidden_size
    qkv = spec.num_kv_heads * (spec.heads_per_group + 2) * hd // tp
    out = {"embedding.word_embeddings.weight": (padded // tp, h), "output_layer.weight": (padded // tp, h),
           "decoder.final_layernorm.weight": (h,)}
    for i in range(spec.num_layers):
        p = f"decoder.layers.{i}."
        out |= {p + "input_layernorm.weight": (h,), p + "self_attention.linear_qkv.weight": (qkv, h),
                p + "self_attention.q_layernorm.weight": (hd,), p + "self_attention.k_layernorm.weight": (hd,),
                p + "self_attention.linear_proj.weight": (h, spec.num_attention_heads * hd // tp),
                p + "pre_mlp_layernorm.weight": (h,)}
        if i == 0:
            out |= {p + "mlp.linear_fc1.weight": (2 * spec.ffn_hidden_size // tp, h),
                    p + "mlp.linear_fc2.weight": (h, spec.ffn_hidden_size // tp)}
            continue
        out[p + "mlp.router.weight"] = (spec.num_experts, h)
        for j in range(spec.num_experts // ep):
            out |= {p + f"mlp.experts.local_experts.{j}.linear_fc1.weight": (2 * f, h),
                    p + f"mlp.experts.local_experts.{j}.linear_fc2.weight": (h, f)}
    return out


# (tp, dp, ep) -> each global rank's (tp_rank, dp_rank, ep_rank), as megatron-core places them on 2 ranks.
GRIDS = {"ep2_dp2": (1, [RankCoords(0, 0, 0, 0), RankCoords(1, 0, 1, 1)], 2),
         "tp2": (2, [RankCoords(0, 0, 0, 0), RankCoords(1, 1, 0, 0)], 1),
         "ep2_tp2": (2, [RankCoords(0, 0, 0, 0), RankCoords(1, 1, 0, 1)], 2)}


@pytest.mark.parametrize("grid", sorted(GRIDS))
def test_push_plan_rebuilds_the_hf_model_from_tp_and_ep_ranks(model, grid: str) -> None:
    hf, spec = model
    tp, coords, ep = GRIDS[grid]
    padded = padded_vocab_size(VOCAB, tp, 4)
    # Every rank's layouts and shards, as its trainer actor holds them.
    rank_layouts = {c.rank: {n: layout_for(n, s, spec, c.tp_rank, tp, padded, c.ep_rank, ep)
                             for n, s in megatron_shapes(spec, tp, ep, padded).items()} for c in coords}
    senders = weight_senders(coords, tp)
    holders = expert_senders(coords, senders, ep, spec.num_experts)
    # What the trainer role hands weight sync: rank 0's layouts, each expert's repeated for every EP rank.
    layouts = [expanded for lay in rank_layouts[0].values()
               for expanded in ([lay] if lay.expert is None else
                                [expert_on_rank(lay, r, ep, spec.num_experts) for r in range(ep)])]
    specs = specs_from_layouts(layouts, "float32", holders)
    shards = [{n: lay.assemble(hf) for n, lay in rank_layouts[rank].items()
               if i < tp or lay.expert is not None} for i, rank in enumerate(senders)]
    assert sender_count(specs, tp) == len(senders)
    for i in range(len(senders)):  # what the plan reads of each sender, among what it holds
        needed = source_shapes(specs, tp, i)
        assert needed.items() <= {n: tuple(t.shape) for n, t in shards[i].items()}.items()
        assert needed.keys() >= {n for n in shards[i] if "experts" not in n}
    rebuilt = apply_rank_plan(full_tensor_plan(specs, tp), shards)
    assert set(rebuilt) == set(hf)
    for name, tensor in hf.items():
        assert torch.equal(rebuilt[name], tensor), name
    # Each expert comes from the sender on its EP rank; the dense MLP of layer 0 from every TP rank.
    plan = build_plan(specs, tp, [EngineSpec("one", 1, vocab_pad_to=8), EngineSpec("two", 2, vocab_pad_to=8)])
    sources = {s.name: {t.src_rank for t in s.transfers} for s in plan.ranks[0][0].shards}
    per_rank = spec.num_experts // ep
    for e in range(spec.num_experts):
        sender = senders.index(next(c.rank for c in coords if c.ep_rank == e // per_rank))
        assert sources[f"model.layers.1.mlp.experts.{e}.gate_proj.weight"] == {sender}
        assert sources[f"model.layers.1.mlp.experts.{e}.down_proj.weight"] == {sender}
    assert sources["model.layers.0.mlp.gate_proj.weight"] == set(range(tp))
    out = apply_plan(plan, shards)
    assert all(torch.equal(out["one"][0][n], hf[n]) for n in hf)
    # A TP=2 engine (SGLang's TP MoE): an expert's gate/up split on dim 0, down on dim 1.
    gate = hf["model.layers.1.mlp.experts.3.gate_proj.weight"]
    down = hf["model.layers.1.mlp.experts.3.down_proj.weight"]
    for r in range(2):
        assert torch.equal(out["two"][r]["model.layers.1.mlp.experts.3.gate_proj.weight"], gate.chunk(2)[r])
        assert torch.equal(out["two"][r]["model.layers.1.mlp.experts.3.down_proj.weight"], down.chunk(2, dim=1)[r])


def test_senders_cover_every_expert_parallel_rank() -> None:
    # TP=2, DP=2, EP=4 over 4 ranks: DP rank 0's TP ranks are EP ranks 0 and 1; ranks 2 and 3 hold EP ranks 2, 3.
    coords = [RankCoords(0, 0, 0, 0), RankCoords(1, 1, 0, 1), RankCoords(2, 0, 1, 2), RankCoords(3, 1, 1, 3)]
    senders = weight_senders(coords, 2)
    assert senders == [0, 1, 2, 3]
    assert expert_senders(coords, senders, 4, 8) == {0: 0, 1: 0, 2: 1, 3: 1, 4: 2, 5: 2, 6: 3, 7: 3}
    # EP=1: every expert on TP rank 0, no extra sender.
    flat = [RankCoords(0, 0, 0, 0), RankCoords(1, 1, 0, 0), RankCoords(2, 0, 1, 0), RankCoords(3, 1, 1, 0)]
    assert weight_senders(flat, 2) == [0, 1]
    assert set(expert_senders(flat, [0, 1], 1, 8).values()) == {0}
    with pytest.raises(ValueError, match="trainer.ep=3"):
        expert_senders(coords, senders, 3, 8)


def test_a_whole_tensor_holder_is_an_expert_kind() -> None:
    with pytest.raises(PlanError, match="holder=1"):
        ParamSpec("model.norm.weight", (4,), kind="replicated", holder=1)
    a = ParamSpec("x.experts.0.down_proj.weight", (4, 2), kind="row", holder=0, source="fc2")
    b = ParamSpec("x.experts.2.down_proj.weight", (4, 2), kind="row", holder=1, source="fc2")
    # The same Megatron name on two senders: two tensors, both planned.
    plan = full_tensor_plan([a, b], 1)
    assert [t.src_rank for s in plan.shards for t in s.transfers] == [0, 1]
    with pytest.raises(PlanError, match="2 trainer shards for 3 senders|senders"):
        apply_plan(build_plan([a, ParamSpec("y", (2, 2), kind="row", holder=2)], 1, [EngineSpec("e", 1)]),
                   [{"fc2": torch.zeros(4, 2)}, {"fc2": torch.zeros(4, 2)}])
