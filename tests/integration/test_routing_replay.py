"""Rollout routing replay on a tiny Qwen3-MoE: forced expert ids reach the trainer's routers."""

from __future__ import annotations

from typing import Any

import pytest
from moe_scenarios import scenario_replay
from trainer_harness import run_ranks


def _max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(max(abs(x - y) for x, y in zip(r1, r2, strict=True)) for r1, r2 in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def res(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("replay")
    return run_ranks(scenario_replay, 1, root / "out", root=str(root / "ckpt"))[0]


def test_forced_experts_are_the_ones_the_forward_used(res: dict[str, Any]) -> None:
    # The rollout's ids are the experts transformers' router ranks last: replayed, the trainer's log-probs
    # equal transformers' with those experts forced, and differ from its own routing's.
    assert _max_diff(res["forced"], res["hf_forced"]) < 1e-4
    assert _max_diff(res["forced"], res["plain"]) > 1e-2
    # Replay off: the same ids change nothing.
    assert _max_diff(res["off_forced"], res["plain"]) < 1e-6
    assert res["dtype"] == "int8"


def test_router_metrics_and_gates_learn_under_replay(res: dict[str, Any]) -> None:
    forced, same, off = res["stats_forced"], res["stats_same"], res["stats_off"]
    assert forced["moe/router_agreement"] == 0.0  # never the trainer's own choice
    assert off["moe/router_agreement"] == 0.0  # reported with replay off as well
    assert same["moe/router_agreement"] > 0.9  # the rollout routed as the trainer does (ties and float noise aside)
    for stats in (forced, same, off):
        for key in ("moe/layer1/load_max_share", "moe/layer2/load_cv", "moe/aux_loss", "moe/load_max_share"):
            assert key in stats and stats[key] >= 0.0
        assert 0.125 <= stats["moe/layer1/load_max_share"] <= 1.0
    # The gates of replayed experts come from the trainer's router logits: the router trains.
    assert res["router_moved"] > 0.0
