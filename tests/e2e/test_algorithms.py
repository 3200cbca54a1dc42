"""End to end through `miles-lite train`, shortened: DAPO refill with several PPO updates per rollout batch,
and two-step-off async rollouts with a staleness bound."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

SHORT = ["data.presample.enabled=false", "rollout.prompts_per_step=4", "rollout.group_size=4",
         "data.synthetic.eval_size=4", "observability.progress=false", "experiment.run_name=run",
         "rollout.engines=1"]


def _run(tmp_path: Path, *overrides: str) -> list[dict[str, Any]]:
    cmd = [sys.executable, "-m", "miles_lite.cli", "train", f"experiment.output_dir={tmp_path}", *SHORT, *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1100)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def test_dapo_refill_trains_full_batches_with_several_clipped_updates(tmp_path: Path):
    # Binary rewards (format and a bare SOLUTION number) after a short SFT: many groups are all 0 or all 1.
    records = _run(tmp_path, "experiment.steps=3", "experiment.warmup_steps=20", "rewards.set=correctness_only",
                   "+rewards.weights.format_check=1.0", "+rewards.weights.solution_number_check=1.0",
                   "rollout.dynamic_sampling=true", "rollout.max_sampling_rounds=6",
                   "algo.updates_per_rollout=4", "trainer.lr=2e-3", "trainer.lr_warmup_steps=0")
    assert [r["step"] for r in records] == [1, 2, 3]
    # The RL steps run at trainer.lr's schedule (cosine from 2e-3, no warm-up), not at the SFT warm-up's 3e-3.
    assert records[0]["lr"] == pytest.approx(2e-3) and records[1]["lr"] < 2e-3
    for r in records:
        # Every group trained on has signal; the batch is full unless the rounds ran out (then counted).
        assert r["algo/zero_signal_share"] == 0.0, r
        assert r["algo/groups"] + r["rollout/groups_short"] == 4, r
        if r["rollout/refill_prompts"] > 0:
            assert r["rollout/dynamic_sampling_rounds"] >= 2 and r["rollout/dropped_groups"] >= 1, r
        if r["algo/groups"]:
            assert r["policy/updates"] == 4.0, r
    assert sum(r["rollout/dropped_groups"] for r in records) >= 1
    assert sum(r["rollout/refill_prompts"] for r in records) >= 1
    assert any(r["algo/groups"] == 4 for r in records)
    # Four optimizer steps against the policy from before the first: the later ones clip.
    assert max(r.get("policy/clip_frac", 0.0) for r in records) > 0
    assert max(r.get("policy/ratio_spread", 0.0) for r in records) > 0.28


def test_two_steps_off_async_trains_and_drops_what_is_too_stale(tmp_path: Path):
    # Both batches ahead must finish while the step before them trains, on its weights: 4-token completions
    # (~0.1 s a batch) against a train step of one sequence per micro-batch (~0.4-1 s). With the default
    # budget the padded train step (~0.1 s) ends first and the push resumes them on newer weights.
    # Zero-signal groups stay in the batch (an untrained model has many), so every kept group trains.
    records = _run(tmp_path, "experiment.steps=5", "experiment.warmup=none", "rollout.max_new_tokens=4",
                   "trainer.micro_batch_tokens=32", "rollout.async_steps=2", "rollout.max_staleness=1",
                   "algo.drop_zero_signal=false")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    for r in records:
        assert r["rollout/staleness_max"] <= 2.0, r
        lags = {k: v for k, v in r.items() if k.startswith("rollout/staleness_samples/")}
        assert sum(lags.values()) == 16 and r["rollout/stale_dropped"] <= 4, r
        if r["rollout/stale_dropped"] < 4:
            assert r["algo/trained_sequences"] > 0, r
    assert records[0]["rollout/staleness_max"] == 0.0
    assert any(r["rollout/staleness_max"] == 2.0 and r["rollout/stale_dropped"] >= 1 for r in records)
    assert sum(1 for r in records if r["algo/trained_sequences"] > 0) >= 2
