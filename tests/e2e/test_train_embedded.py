"""End to end: `miles-lite train` on the embedded default, shortened; then `miles-lite eval` on its model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]


def test_short_embedded_run_writes_every_artifact(tmp_path: Path):
    cmd = [sys.executable, "-m", "miles_lite.cli", "train", f"experiment.output_dir={tmp_path}",
           "experiment.run_name=e2e", "experiment.steps=2", "experiment.warmup_steps=60",
           "data.presample.max_questions=16", "data.presample.k=4", "rollout.prompts_per_step=4",
           "rollout.group_size=4", "data.synthetic.eval_size=16", "observability.progress=false"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = tmp_path / "e2e"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps_done"] == 2 and not summary["stopped_by_signal"]
    assert 0.0 <= summary["before"]["exact"] <= 1.0 and 0.0 <= summary["after"]["exact"] <= 1.0
    # The SFT warm-up teaches the tag format before RL starts.
    assert summary["before"]["exact_format"] > 0.5, summary
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1]
    for key in ("reward/mean", "mismatch/logp_abs_diff_mean", "mismatch/is_raw_mean", "sync/seconds",
                "algo/zero_signal_share", "time/train_seconds"):
        assert key in records[-1], key
    # Every push was verified: the probe's trainer/engine logprob gap is tiny on identical fp32 weights.
    assert records[-1]["sync/probe_logp_diff_mean"] < 1e-3
    assert (run / "config.yaml").is_file() and (run / "curves.png").stat().st_size > 1000
    assert sorted(p.name for p in (run / "rollouts").iterdir()) == ["step_000000.parquet", "step_000001.parquet"]
    assert "presample" in proc.stdout + proc.stderr

    evaluated = subprocess.run([sys.executable, "-m", "miles_lite.cli", "eval", str(run / "initial_model"),
                                "synthetic", "--n", "8", "--log-dir", str(tmp_path / "eval_logs")],
                               capture_output=True, text=True, timeout=600)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert "right answer and exact format" in evaluated.stdout
