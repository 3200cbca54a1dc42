"""Llama 3.1-style (`rope_type: llama3`) and YaRN tiny models: the Megatron trainer's logits equal transformers'."""

from __future__ import annotations

from typing import Any

import pytest
from rope_scenarios import CASES, scenario_rope
from trainer_harness import run_ranks

LOGIT_TOL = 1e-4


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("rope")
    return run_ranks(scenario_rope, 1, root / "out", root=str(root / "ckpt"))[0]


@pytest.mark.parametrize("case", sorted(CASES))
def test_scaled_rope_logits_equal_transformers(results: dict[str, Any], case: str) -> None:
    res = results[case]
    assert res["rope_type"] == case
    assert res["logits_vs_hf"] < LOGIT_TOL
    assert res["logprobs_vs_hf"] < LOGIT_TOL
    # The same weights without scaling give other logits: the comparison above sees the scaling.
    assert res["logits_vs_unscaled_hf"] > 1e-2
    assert res["roundtrip_bit_exact"]
