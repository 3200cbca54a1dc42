"""Qwen3-MoE in the Megatron trainer on CPU/gloo: logits equal transformers', bit-exact HF round trip,
expert parallelism (EP=2 with DP=2 and with TP=2) equal to one rank."""

from __future__ import annotations

from typing import Any

import pytest
from moe_scenarios import scenario_moe_single, scenario_moe_two_ranks
from trainer_harness import run_ranks

LOGIT_TOL = 1e-4


def _max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(max(abs(x - y) for x, y in zip(r1, r2, strict=True)) for r1, r2 in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("moe_single")
    return run_ranks(scenario_moe_single, 1, root / "out", root=str(root / "ckpt"))[0]


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("moe_two")
    return run_ranks(scenario_moe_two_ranks, 2, root / "out", root=str(root / "ckpt"))


def _conversion_ok(res: dict[str, Any]) -> None:
    assert res["logits_max_diff"] < LOGIT_TOL
    assert res["logprobs_vs_hf"] < LOGIT_TOL
    assert res["mixed_together_vs_hf"] < LOGIT_TOL and res["mixed_alone_vs_hf"] < LOGIT_TOL
    assert res["packed_vs_unpacked"] < 1e-5


def test_logits_and_logprobs_equal_transformers(single: dict[str, Any]) -> None:
    _conversion_ok(single["conversion"])


def test_hf_round_trip_is_bit_exact(single: dict[str, Any]) -> None:
    assert single["conversion"]["roundtrip_keys_equal"] and single["conversion"]["roundtrip_bit_exact"]


@pytest.mark.parametrize("key", ["ep2_dp2", "ep2_tp2"])
def test_expert_parallel_conversion_and_placement(two: list[dict[str, Any]], key: str) -> None:
    for res in (r[key] for r in two):
        _conversion_ok(res)
        # EP rank r holds experts 4r..4r+3 of the 8.
        assert res["experts"] == list(range(4 * res["ep_rank"], 4 * res["ep_rank"] + 4))
    assert sorted(r[key]["ep_rank"] for r in two) == [0, 1]
    assert two[0][key]["roundtrip_keys_equal"] and two[0][key]["roundtrip_bit_exact"]


@pytest.mark.parametrize("key", ["ep2_dp2", "ep2_tp2"])
def test_expert_parallel_train_step_equals_one_rank(single: dict[str, Any], two: list[dict[str, Any]],
                                                    key: str) -> None:
    ref = single["train"]
    for rank_res in two:
        res = rank_res[key]["train"]
        assert _max_diff(res["before"], ref["before"]) < 1e-5
        assert _max_diff(res["after"], ref["after"]) < 1e-3
        for stat in ("loss/total", "entropy", "grad_norm"):
            assert res["stats"][stat] == pytest.approx(ref["stats"][stat], rel=1e-4, abs=1e-6), (key, stat)
    assert _max_diff(ref["after"], ref["before"]) > 1e-3


# Saved with EP=2 (beside DP=2, beside TP=2), resumed with EP=1 (and TP=1).
LAYOUT_CHANGES = {"ep2_dp2_to_ep1_dp2": (dict(dp=2, ep=2), dict(dp=2, ep=1)),
                  "ep2_tp2_to_ep1_dp2": (dict(tp=2, ep=2), dict(dp=2, ep=1))}


@pytest.fixture(scope="module", params=sorted(LAYOUT_CHANGES))
def resume(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    from moe_scenarios import scenario_moe_resume

    save, resumed = LAYOUT_CHANGES[request.param]
    root = tmp_path_factory.mktemp("moe_resume")
    return run_ranks(scenario_moe_resume, 2, root / "out", root=str(root / "ckpt"), save=save, resume=resumed)


def test_checkpoint_resumes_across_an_ep_and_tp_change(resume: list[dict[str, Any]]) -> None:
    for res in resume:
        assert _max_diff(res["resumed_logprobs"], res["saved_logprobs"]) < 1e-5
        # The next step equals the uninterrupted run's: Adam's moments and step came back for every expert.
        for stat in ("loss/total", "grad_norm"):
            assert res["resumed_next"][stat] == pytest.approx(res["saved_next"][stat], rel=1e-4, abs=1e-6), stat
        assert _max_diff(res["resumed_after"], res["saved_after"]) < 1e-4
        assert _max_diff(res["saved_after"], res["saved_logprobs"]) > 1e-3


def test_hf_export_of_expert_parallel_model_loads_in_transformers(resume: list[dict[str, Any]]) -> None:
    assert resume[0]["export_logits_diff"] < LOGIT_TOL
