"""Run progress: the per-step summary line and the rich progress bar."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest
from rich.console import Console

from miles_lite.observability import RunProgress, format_summary

STATS = {
    "reward/mean": 2.4137, "reward/exact_accuracy": 0.375, "algo/zero_signal_share": 0.25,
    "mismatch/logp_abs_diff_mean": 0.00312, "mismatch/is_raw_mean": 1.0021, "mismatch/is_applied_mean": 0.9984,
    "mismatch/masked_fraction": 0.0041, "time/sync_seconds": 0.8412, "rollout/tokens_per_second": 1520.4,
}


def test_summary_line_has_every_field() -> None:
    line = format_summary(12, 200, STATS)
    assert line == ("step 12/200 | reward 2.414 | exact 0.38 | zero-signal 0.25 | logp diff 0.0031 | "
                    "IS raw 1.002 / applied 0.998 / masked 0.004 | sync 0.84s | 1520 tok/s")


def test_missing_and_nonfinite_values_are_not_invented() -> None:
    line = format_summary(1, 5, {"reward/mean": float("nan"), "reward/exact_accuracy": "n/a"})
    assert "reward nan" in line and "exact -" in line and "sync -" in line and "- tok/s" in line


def test_progress_prints_one_line_per_step() -> None:
    out = io.StringIO()
    console = Console(file=out, force_terminal=False, width=200)
    with RunProgress(3, console=console) as progress:
        for step in (1, 2, 3):
            progress.step_done(step, STATS)
    text = out.getvalue()
    assert [ln for ln in text.splitlines() if ln.startswith("step ")] == progress.lines
    assert len(progress.lines) == 3 and progress.lines[-1].startswith("step 3/3 | reward 2.414")
    with pytest.raises(ValueError, match="experiment.steps"):
        RunProgress(0, console=console)


def test_summary_lines_stay_whole_when_piped_to_a_file(tmp_path) -> None:
    code = ("from miles_lite.observability import RunProgress; import json, sys; stats = json.loads(sys.argv[1]); "
            "p = RunProgress(2, enabled=False); p.__enter__(); [p.step_done(s, stats) for s in (1, 2)]; p.__exit__(); "
            "p.console.print('x' * 150, markup=False)")
    with open(tmp_path / "log.txt", "w") as log:  # a file, not a terminal
        subprocess.run([sys.executable, "-c", code, json.dumps(STATS)], stderr=log, check=True, timeout=60)
    lines = (tmp_path / "log.txt").read_text().splitlines()
    assert lines == [format_summary(1, 2, STATS), format_summary(2, 2, STATS), "x" * 150]
    assert len(lines[0]) > 80
