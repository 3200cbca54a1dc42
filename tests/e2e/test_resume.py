"""A run stopped after 2 steps resumes from its checkpoint (same run directory) and finishes the rest."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

SHORT = ["experiment.run_name=resume", "experiment.warmup_steps=10", "data.presample.enabled=false",
         "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=16",
         "data.synthetic.eval_size=4", "observability.progress=false", "checkpoint.interval=1"]


def _train(tmp_path: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "miles_lite.cli", "train", f"experiment.output_dir={tmp_path}", *SHORT, *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_resume_continues_from_the_newest_checkpoint(tmp_path: Path):
    _train(tmp_path, "experiment.steps=2")
    ckpts = tmp_path / "resume" / "checkpoints"
    assert (ckpts / "latest").is_file()
    first = [json.loads(x)["step"] for x in (tmp_path / "resume" / "metrics.jsonl").read_text().splitlines()]
    assert first == [1, 2]

    proc = _train(tmp_path, "experiment.steps=3")
    out = proc.stdout + proc.stderr
    assert "resumed from" in out and "at step 2" in out
    steps = [json.loads(x)["step"] for x in (tmp_path / "resume" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]  # only the missing step ran; the warm-up was not repeated
    assert "sft warm-up" not in out
    summary = json.loads((tmp_path / "resume" / "summary.json").read_text())
    assert summary["steps_done"] == 3
    # A resumed run numbers weight versions as an uninterrupted one: step k's completions came from version k - 1.
    from miles_lite.observability.rollout_table import read_rollouts

    table = read_rollouts(tmp_path / "resume").to_pylist()
    assert {(r["step"], r["weight_version"]) for r in table} == {(1, "0"), (2, "1"), (3, "2")}
