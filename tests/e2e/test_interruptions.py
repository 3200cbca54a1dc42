"""Short runs of the embedded default, interrupted or diverging: a stop signal during the SFT warm-up ends
the run within a step, a second Ctrl-C aborts at once, and a learning rate that explodes the weights
is refused step by step, then ends the run with the last good weights checkpointed and the reason said."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from miles_lite.checkpoint import CheckpointReader

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SHORT = ["experiment.run_name=run", "data.presample.enabled=false", "rollout.engines=1", "rollout.prompts_per_step=2",
         "rollout.group_size=2", "rollout.max_new_tokens=8", "data.synthetic.eval_size=1",
         "observability.progress=false"]


def _start(tmp_path: Path, *overrides: str) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-u", "-m", "miles_lite.cli", "train", f"experiment.output_dir={tmp_path}", *SHORT,
           *overrides]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_for(proc: subprocess.Popen[str], text: str, seen: list[str], timeout: float = 400) -> None:
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        if text in line:
            return
    proc.kill()
    raise AssertionError(f"{text!r} never printed:\n{''.join(seen)[-3000:]}")


def _finish(proc: subprocess.Popen[str], seen: list[str], timeout: float = 120) -> str:
    out, _ = proc.communicate(timeout=timeout)
    return "".join(seen) + out


def test_sigterm_during_the_warmup_stops_within_a_step(tmp_path: Path) -> None:
    proc = _start(tmp_path, "experiment.warmup_steps=100000", "experiment.steps=5")
    seen: list[str] = []
    _wait_for(proc, "sft warm-up 1/100000", seen)
    warmup_log = tmp_path / "run" / "warmup.jsonl"
    logged = len(warmup_log.read_text().splitlines())  # each step appends its line when it ends
    proc.send_signal(signal.SIGTERM)
    out = _finish(proc, seen)
    assert proc.returncode == 0, out[-3000:]
    assert "received SIGTERM; stopping after this step" in out
    assert "sft warm-up stopped after step" in out and "Traceback" not in out
    # The warm-up stopped after the step in progress at the signal (one more may end between reading the
    # log and signalling), not the 100000 asked, and logged exactly the steps it took.
    stopped = re.search(r"sft warm-up stopped after step (\d+)/100000", out)
    assert stopped is not None, out[-3000:]
    done = int(stopped.group(1))
    assert logged <= done <= logged + 2, (logged, done)
    warmup = [json.loads(line) for line in warmup_log.read_text().splitlines()]
    assert [r["step"] for r in warmup] == list(range(1, done + 1)), [r["step"] for r in warmup]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["stopped_by_signal"] and summary["steps_done"] == 0
    assert "SIGTERM" in summary["stopped_reason"]
    # No step-0 checkpoint: resuming it would repeat the warm-up on warmed weights.
    assert not list((tmp_path / "run" / "checkpoints").glob("step_*"))


def test_second_ctrl_c_aborts_at_once(tmp_path: Path) -> None:
    proc = _start(tmp_path, "experiment.warmup_steps=100000", "experiment.steps=5")
    seen: list[str] = []
    _wait_for(proc, "sft warm-up 1/100000", seen)
    proc.send_signal(signal.SIGINT)
    _wait_for(proc, "Ctrl-C again aborts at once", seen, timeout=60)
    proc.send_signal(signal.SIGINT)
    out = _finish(proc, seen, timeout=60)
    assert proc.returncode != 0 and "aborting now" in out, out[-3000:]
    assert "sft warm-up stopped" not in out


def test_exploding_learning_rate_is_refused_and_ends_with_the_last_good_weights(tmp_path: Path) -> None:
    # An entropy bonus gives every step a gradient, whatever the (untrained) model earns.
    proc = _start(tmp_path, "experiment.warmup=none", "experiment.steps=4", "trainer.lr=1e6", "algo.entropy_coef=0.01",
                  "algo.drop_zero_signal=false",
                  "trainer.lr_warmup_steps=0", "trainer.max_diverged_skips=2", "checkpoint.interval=1")
    out = _finish(proc, [], timeout=500)
    assert proc.returncode == 3, out[-3000:]
    run = tmp_path / "run"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped"] for r in records] == [1.0]  # step 2's refusal ended the run before its record
    assert records[0]["update_ratio"] > 0.5
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps_done"] == 1 and not summary["stopped_by_signal"]
    assert "trainer.max_update_ratio=0.5" in summary["stopped_reason"]
    assert "training stopped: 2 optimizer steps in a row" in out
    # Every step was undone: what was checkpointed (and pushed) are the initial weights, bit for bit.
    initial = load_file(str(run / "initial_model" / "model.safetensors"))
    ckpts = sorted((run / "checkpoints").glob("step_*"))
    assert [p.name for p in ckpts] == ["step_00000001"]
    reader = CheckpointReader(ckpts[0])
    names = reader.global_names("model/")
    assert len(names) == len(initial)
    for name in names:
        assert torch.equal(reader.global_tensor(name), initial[name[len("model/"):]]), name
