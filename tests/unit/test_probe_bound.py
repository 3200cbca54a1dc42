"""The probe's bound when `weight_sync.max_probe_logp_diff` is unset: by the precision both sides compute in, the
engines' kernels and the architecture (a bf16 run stopped at its first push under the old fixed 1e-3)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from miles_lite.config import load_config
from miles_lite.config.views import WeightSyncSetup
from miles_lite.config.weight_sync_choice import moe_model, probe_bound


@pytest.mark.parametrize(("overrides", "bound"), [
    ((), 1e-3),                                                             # fp32 trainer, fp32 reference engines
    (("model=tiny_qwen3_moe",), 1e-3),
    (("trainer.precision=bf16",), 1e-2),
    (("trainer.precision=bf16", "model=tiny_qwen3_moe"), 2e-2),
    (("trainer.precision=fp8",), 1e-2),                                     # FP8 trainers score the probe in bf16
    (("+rollout.reference_args.dtype=bfloat16",), 1e-2),                   # a bf16 engine
    (("rollout=sglang",), 0.1),                                             # SGLang serves the checkpoint's bf16
    (("rollout=sglang", "model=tiny_qwen3_moe", "trainer.precision=bf16"), 0.2),
    (("rollout=sglang", "+rollout.sglang_args.dtype=float32"), 1e-3),
    (("trainer.precision=bf16", "weight_sync.max_probe_logp_diff=0.005"), 0.005),  # the user's bound wins
])
def test_the_bound_fits_precision_engines_and_architecture(overrides: tuple[str, ...], bound: float) -> None:
    cfg = load_config(list(overrides))
    got, note = probe_bound(cfg)
    assert got == pytest.approx(bound)
    assert WeightSyncSetup.of(cfg).probe_bound == pytest.approx(bound)
    assert ("set weight_sync.max_probe_logp_diff to override" in note) == ("weight_sync.max_probe_logp_diff=0.005"
                                                                          not in overrides)


def test_a_checkpoint_with_experts_is_a_mixture_of_experts_model(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"num_experts": 8, "num_attention_heads": 4}))
    assert moe_model(load_config([f"model.hf_path={tmp_path}"]))
    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": 4}))
    assert not moe_model(load_config([f"model.hf_path={tmp_path}"]))
