"""Megatron's distributed optimizer on CPU (gloo): checkpoints of its flat shards reshard across DP sizes.

A: DP 2 trains batches 0, 1, 2 straight, saving after batch 0.
B: DP 1 resumes A's checkpoint, trains batch 1 and saves.
C: DP 2 resumes B's checkpoint and trains batch 2.
Each resume loads exactly the state saved (weights, fp32 main values, Adam moments, step counts), and C ends
bit-identical to A: DP 2 -> DP 1 -> DP 2 continues the run as if it had never changed size.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from dist_optimizer_scenarios import scenario
from trainer_harness import run_ranks

pytestmark = [pytest.mark.slow]


def _equal(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Names of the tensors that differ between two `_state`s (empty: bit-identical)."""
    bad = [n for n in a["weights"] if not torch.equal(a["weights"][n], b["weights"][n])]
    for name, (master, moments, step) in a["optim"].items():
        other_master, other_moments, other_step = b["optim"][name]
        if not torch.equal(master, other_master) or step != other_step or moments.keys() != other_moments.keys():
            bad.append(f"optim {name}")
        bad += [f"{k} {name}" for k in moments if not torch.equal(moments[k], other_moments[k])]
    return bad


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("dist_opt")
    a = run_ranks(scenario, 2, root / "a", root=str(root), resume_from=None, save_to=str(root / "ckpt_a"),
                  train_steps=[0, 1, 2], save_after=1)
    b = run_ranks(scenario, 1, root / "b", root=str(root), resume_from=str(root / "ckpt_a"),
                  save_to=str(root / "ckpt_b"), train_steps=[1], save_after=1)
    c = run_ranks(scenario, 2, root / "c", root=str(root), resume_from=str(root / "ckpt_b"),
                  save_to=str(root / "ckpt_c"), train_steps=[2], save_after=None)
    return {"a": a, "b": b, "c": c}


def test_the_optimizer_is_sharded_over_data_parallel_ranks(runs: dict[str, Any]) -> None:
    a0, a1 = runs["a"]
    assert a0["final"]["optim"] is not None and a1["final"]["optim"] is None  # gathered to DP rank 0 only
    assert all(len(moments) == 2 for _, moments, _ in a0["final"]["optim"].values())
    assert not _equal(a0["final"] | {"optim": {}}, a1["final"] | {"optim": {}})  # replicas agree on the weights


def test_dp2_to_dp1_resume_loads_exactly_what_was_saved(runs: dict[str, Any]) -> None:
    a, b = runs["a"][0], runs["b"][0]
    assert a["saved"]["steps_done"] == b["loaded"]["steps_done"] == 1
    assert all(step == 1.0 for _, _, step in b["loaded"]["optim"].values())
    assert _equal(b["loaded"], a["saved"]) == []


def test_dp2_dp1_dp2_continues_bit_exactly(runs: dict[str, Any]) -> None:
    a, b, c = runs["a"][0], runs["b"][0], runs["c"][0]
    assert _equal(c["loaded"], b["saved"]) == []  # DP 1 -> DP 2: every byte as saved
    assert c["final"]["steps_done"] == a["final"]["steps_done"] == 3
    assert _equal(c["final"], a["final"]) == []
