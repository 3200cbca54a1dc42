"""Megatron trainer on CPU/gloo against transformers: conversion, logprobs, packing, RL steps, TP=2 and DP=2.

Two spawned jobs carry every check (process start-up and imports dominate their cost): one rank
with TP=1, and two ranks running TP=2 and then DP=2 on the same checkpoints and batch.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from trainer_harness import run_ranks
from trainer_scenarios import scenario_single, scenario_two_ranks

ARCHS = ("qwen2", "llama", "qwen3")
# fp32 end to end: the two implementations differ only in summation order.
LOGIT_TOL = 1e-4


def _max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(max(abs(x - y) for x, y in zip(r1, r2, strict=True)) for r1, r2 in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("trainer_single")
    return run_ranks(scenario_single, 1, root / "out", root=str(root / "ckpt"))[0]


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("trainer_two")
    return run_ranks(scenario_two_ranks, 2, root / "out", root=str(root / "ckpt"))


@pytest.mark.parametrize("arch", ARCHS)
def test_tp1_logits_and_logprobs_match_transformers(single: dict[str, Any], arch: str) -> None:
    res = single[arch]
    assert res["logits_max_diff"] < LOGIT_TOL
    assert res["logprobs_vs_hf"] < LOGIT_TOL
    assert res["response_lengths_ok"]


@pytest.mark.parametrize("arch", ARCHS)
def test_tp1_packed_chunked_equals_unpacked_unchunked(single: dict[str, Any], arch: str) -> None:
    assert single[arch]["packed_vs_unpacked"] < 1e-5


@pytest.mark.parametrize("arch", ARCHS)
def test_tp1_padded_micro_batches_of_mixed_lengths_match_transformers(single: dict[str, Any], arch: str) -> None:
    res = single[arch]
    assert res["mixed_together_micro_batches"] == 1  # 3..60 tokens in one padded [5, 60] batch
    assert res["mixed_together_vs_hf"] < LOGIT_TOL
    assert res["mixed_alone_micro_batches"] == 5
    assert res["mixed_alone_vs_hf"] < LOGIT_TOL  # one sequence per micro-batch


@pytest.mark.parametrize("key", ["layouts", "layouts_mixed"])
def test_padded_batches_equal_the_packed_row(single: dict[str, Any], key: str) -> None:
    res = single[key]
    padded, packed = res["logprobs"]
    assert _max_diff(padded[0], packed[0]) < 1e-5
    for step, loss in (("sft", "loss/sft"), ("rl", "loss/total")):
        (p_stats, p_grads), (q_stats, q_grads) = res[step]
        assert p_stats[loss] == pytest.approx(q_stats[loss], rel=1e-5, abs=1e-7), step
        assert p_stats["grad_norm"] == pytest.approx(q_stats["grad_norm"], rel=1e-5), step
        assert p_grads.abs().max() > 0
        torch.testing.assert_close(p_grads, q_grads, rtol=1e-4, atol=1e-6)
    # The padded plan counts padding, so the same budget (40) gives it more micro-batches.
    assert res["micro_batches"] > res["packed_micro_batches"]


def test_cpu_trainer_runs_where_transformer_engine_imports(single: dict[str, Any]) -> None:
    # Megatron-core defaults the block's final norm and the optimizer's Adam and multi-tensor kernels to
    # TransformerEngine's (CUDA only) when TE imports, as in the GPU image: on CPU the trainer uses
    # torch's, and a step equals one built without TE in sight.
    res = single["te_installed"]
    assert res["final_norm"] == "RMSNorm"
    assert res["logprobs_vs_hf"] < LOGIT_TOL
    got, expected = res["grad_norm"]
    assert got == expected and got > 0
    assert res["after_step_diff"] == 0.0 and res["step_moved"] > 1e-4


@pytest.mark.parametrize("arch", ARCHS)
def test_tp1_hf_round_trip_is_bit_exact(single: dict[str, Any], arch: str) -> None:
    assert single[arch]["roundtrip_keys_equal"]
    assert single[arch]["roundtrip_bit_exact"]


@pytest.mark.parametrize("arch", ARCHS)
def test_tp2_logits_logprobs_and_round_trip(two: list[dict[str, Any]], arch: str) -> None:
    for rank_res in two:
        res = rank_res[arch]
        assert res["logits_max_diff"] < LOGIT_TOL
        assert res["logprobs_vs_hf"] < LOGIT_TOL
        assert res["packed_vs_unpacked"] < 1e-5
        assert res["mixed_together_vs_hf"] < LOGIT_TOL and res["mixed_alone_vs_hf"] < LOGIT_TOL
    assert two[0][arch]["roundtrip_keys_equal"] and two[0][arch]["roundtrip_bit_exact"]


def test_tp2_layouts_describe_shards(two: list[dict[str, Any]]) -> None:
    lay0, lay1 = two[0]["qwen2"]["layouts"], two[1]["qwen2"]["layouts"]
    kind, hf_names, local, full = lay0["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert kind == "qkv_fused" and hf_names[0].endswith("q_proj.weight")
    assert full[0] == 2 * local[0]
    assert lay1["decoder.layers.0.self_attention.linear_proj.weight"][0] == "row_parallel"
    # 500 rows padded to a multiple of tp * 128 = 256 -> 512, split in two.
    assert lay1["embedding.word_embeddings.weight"][2:] == ((256, 64), (512, 64))
    assert "output_layer.weight" not in lay0  # tied embeddings


def test_train_step_moves_logprobs_with_the_advantage(single: dict[str, Any]) -> None:
    train = single["train"]
    stats = train["stats"]
    assert stats["skipped"] == 0.0 and stats["grad_norm"] > 0 and stats["tokens"] > 0
    assert stats["mismatch/kl_k3"] == pytest.approx(0.0, abs=1e-9)  # on-policy rollout logprobs
    for before, after, adv in zip(train["before"], train["after"], [1, -1, 1, -1, 1, -1], strict=True):
        assert (sum(after) - sum(before)) * adv > 0


def test_distill_coef_of_one_batch_overrides_the_config(single: dict[str, Any]) -> None:
    on, off = single["distill_on"], single["distill_off"]
    assert on["loss/distill"] != 0.0 and on["distill/reverse_kl"] > 0
    assert "loss/distill" not in off and "distill/reverse_kl" not in off


def test_one_update_per_rollout_never_clips(single: dict[str, Any]) -> None:
    stats = single["train"]["stats"]
    assert stats["policy/updates"] == 1.0
    assert stats["policy/clip_frac"] == 0.0 and stats["policy/ratio_spread"] == pytest.approx(0.0, abs=1e-6)


def test_several_updates_per_rollout_clip_against_the_old_policy(single: dict[str, Any]) -> None:
    ppo = single["ppo"]
    stats = ppo["stats"]
    assert stats["policy/updates"] == 6.0 and ppo["optimizer_steps"] == 6 and stats["skipped"] == 0.0
    # The first update starts at ratio 1; later ones see the policy moved by earlier ones (lr 1e-2).
    assert stats["policy/clip_frac"] > 0 and stats["policy/ratio_spread"] > 0.2
    assert stats["policy/approx_kl"] > 0
    # The LR schedule advances once per rollout batch, not once per optimizer step.
    assert ppo["lr_after"] == pytest.approx(ppo["lr_before"] * 0.9)
    for before, after, adv in zip(ppo["before"], ppo["after"], [1, -1, 1, -1, 1, -1], strict=True):
        assert (sum(after) - sum(before)) * adv > 0


def test_tp2_and_dp2_train_steps_equal_tp1(single: dict[str, Any], two: list[dict[str, Any]]) -> None:
    ref = single["train"]
    for key in ("train_tp2", "train_dp2"):
        for rank_res in two:
            res = rank_res[key]
            assert _max_diff(res["before"], ref["before"]) < 1e-5
            assert _max_diff(res["after"], ref["after"]) < 1e-3
            for stat in ("loss/total", "entropy", "grad_norm"):
                assert res["stats"][stat] == pytest.approx(ref["stats"][stat], rel=1e-4, abs=1e-6), (key, stat)


def test_reference_is_the_initial_policy(single: dict[str, Any]) -> None:
    assert _max_diff(single["reference"], single["train"]["before"]) == 0.0
    assert _max_diff(single["train"]["after"], single["train"]["before"]) > 1e-3


def test_teacher_vocab_is_trimmed_to_the_shared_vocabulary(single: dict[str, Any]) -> None:
    assert _max_diff(single["teacher"], single["teacher_hf_trimmed"]) < LOGIT_TOL
    # The 140 extra teacher rows carry probability mass: without the trim the answer would differ.
    assert _max_diff(single["teacher"], single["teacher_hf_untrimmed"]) > 1e-2


def test_checkpoint_state_restores_a_bit_identical_step(single: dict[str, Any]) -> None:
    assert single["ckpt_max_diff"] == 0.0


def test_nan_guard_skips_then_stops(single: dict[str, Any]) -> None:
    stats = single["nan_stats"]
    assert stats["skipped"] == 1.0 and stats["nonfinite_total"] == 1.0
    assert single["nan_weights_unchanged"]
    assert "max_nonfinite_skips=2" in (single["nan_limit_error"] or "")
    assert single["nan_weights_finite"]

