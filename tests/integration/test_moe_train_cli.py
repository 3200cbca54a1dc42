"""`miles-lite train model=tiny_qwen3_moe trainer.routing_replay=true` on CPU: reference engines return the
routed experts, samples carry them to the trainer, weight pushes (every expert) are verified by the probe."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(900)


def test_moe_run_with_routing_replay(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "miles_lite.cli", "train", "model=tiny_qwen3_moe", "trainer.routing_replay=true",
           "experiment.warmup=none", "experiment.steps=2", "algo.drop_zero_signal=false",
           "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=8",
           "data.synthetic.eval_size=20", f"experiment.output_dir={tmp_path}", "experiment.run_name=run",
           "observability.progress=false"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    trained = [s for s in steps if "moe/router_agreement" in s]
    assert len(trained) == 2, [sorted(k for k in s if k.startswith("moe/")) for s in steps]
    for stats in trained:
        # The rollout's routing reached the trainer: the engines ran the pushed weights, so the trainer's
        # routers mostly pick what they picked (ties and float noise aside).
        assert stats["moe/router_agreement"] > 0.9
        for layer in (1, 2):  # layer 0 is dense
            assert 0.125 <= stats[f"moe/layer{layer}/load_max_share"] <= 1.0
            assert stats[f"moe/layer{layer}/load_cv"] >= 0.0
        assert "moe/layer0/load_cv" not in stats
        assert stats["moe/aux_loss"] > 0.0
        assert stats["sync/probe_logp_diff_max"] < 1e-4  # every push verified, experts included
        assert stats["mismatch/logp_abs_diff_mean"] < 1e-3
