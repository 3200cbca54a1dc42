"""Resuming through `miles-lite train` with another configuration: what the checkpoint cannot take is refused
before any work (the run directory untouched), what it can take is applied and listed; a resume on other
training data is refused unless `checkpoint.allow_data_change=true`; a failing reward plug-in ends the run
with one console line, exit code 4 and the last committed checkpoint as the resume point."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from miles_lite.checkpoint import CheckpointReader
from miles_lite.checkpoint.layout import load_manifest, read_latest
from miles_lite.checkpoint.resume import verify_checkpoint
from miles_lite.data.arithmetic import ArithmeticSpec, write_dataset
from miles_lite.data.identity import file_sha256
from miles_lite.run.failure import EXIT_PLUGIN_FAILED

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SHORT = ["experiment.run_name=run", "experiment.warmup=none", "data.presample.enabled=false", "rollout.engines=1",
         "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=16", "rollout.async_steps=0",
         "experiment.eval_size=0", "observability.progress=false", "checkpoint.interval=1",
         # every group trains, so every step reports its learning rate
         "algo.drop_zero_signal=false", "trainer.lr_schedule=constant", "trainer.lr_warmup_steps=0"]


def _train(tmp_path: Path, *extra: str, pythonpath: str = "") -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (pythonpath, os.environ.get("PYTHONPATH", "")) if p)}
    cmd = [sys.executable, "-m", "miles_lite.cli", "train", f"experiment.output_dir={tmp_path}", *SHORT, *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)


def _ok(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _files(root: Path) -> dict[str, float]:
    # Files only (a directory's time changes when the start-up probe writes and removes a file in it).
    return {str(p.relative_to(root)): p.stat().st_mtime for p in sorted(root.rglob("*")) if p.is_file()
            and p.name != ".lock"}


def test_resume_refuses_a_new_model_shape_untouched_and_applies_a_new_learning_rate(tmp_path: Path):
    run = tmp_path / "run"
    _ok(_train(tmp_path, "experiment.steps=2", "trainer.lr=0.0005"))
    config_before = (run / "config.yaml").read_bytes()
    before = _files(run)

    start = time.monotonic()
    proc = _train(tmp_path, "experiment.steps=4", "trainer.lr=0.0005", "model.shape.hidden_size=128",
                  "model.shape.num_layers=3")
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    # Both refused changes at once, each with the recorded value and the fix; no engine or trainer started.
    assert "model.shape.hidden_size: the checkpoint has 64 (asked: 128)" in proc.stderr
    assert "model.shape.num_layers: the checkpoint has 2 (asked: 3)" in proc.stderr
    assert "start a new run" in proc.stderr and "checkpoint.resume=none" in proc.stderr
    assert "Prometheus" not in proc.stdout and "step " not in proc.stdout
    assert time.monotonic() - start < 60
    assert (run / "config.yaml").read_bytes() == config_before
    assert _files(run) == before  # nothing written: no config, checkpoint, metric or model file

    out = _ok(_train(tmp_path, "experiment.steps=4", "trainer.lr=0.001", "experiment.warmup_steps=7"))
    line = next(x for x in out.splitlines() if "with changed settings" in x)
    assert "trainer.lr 0.0005 -> 0.001" in line and "experiment.steps 2 -> 4" in line
    assert "no effect on this run" in line and "experiment.warmup_steps 500 -> 7" in line
    assert [m["lr"] for m in _metrics(run)] == pytest.approx([0.0005, 0.0005, 0.001, 0.001])
    changes = json.loads((run / "summary.json").read_text())["config_changes"]
    assert {"field": "trainer.lr", "from": 0.0005, "to": 0.001} in changes["applied"]
    assert changes["no_effect"] == [{"field": "experiment.warmup_steps", "from": 500, "to": 7}]
    # Every start's configuration is kept: the first as it was, the latest saying where it started.
    assert (run / "config.from_step_0.yaml").read_bytes() == config_before
    latest = (run / "config.yaml").read_text()
    assert latest.startswith("# miles-lite: the configuration of the start at step 2\n") and "lr: 0.001" in latest
    assert "lr: 0.0005" in (run / "config.from_step_0.yaml").read_text()


def test_resume_on_a_changed_data_file_is_refused_unless_allowed_and_the_cursor_restarts(tmp_path: Path):
    data = tmp_path / "train.jsonl"
    write_dataset(data, 40, ArithmeticSpec(max_steps=1, max_operand=5, seed=1))
    run = tmp_path / "run"
    source = ["data.source=gsm8k", f"data.train_path={data}"]
    _ok(_train(tmp_path, *source, "experiment.steps=2"))
    recorded = load_manifest(run / "checkpoints" / "step_00000002").meta["data_identity"]
    assert recorded["key"] == {"bytes": data.stat().st_size, "sha256": file_sha256(data)}

    write_dataset(data, 40, ArithmeticSpec(max_steps=1, max_operand=5, seed=2))  # same path, other problems
    before = _files(run)
    proc = _train(tmp_path, *source, "experiment.steps=3")
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "the checkpoint's prompt cursor indexes file " + str(data.resolve()) in proc.stderr
    assert recorded["key"]["sha256"][:12] in proc.stderr and "checkpoint.allow_data_change=true" in proc.stderr
    assert _files(run) == before

    out = _ok(_train(tmp_path, *source, "experiment.steps=3", "checkpoint.allow_data_change=true"))
    assert "the prompt cursor restarts on the new data" in out
    step3 = run / "checkpoints" / "step_00000003"
    assert load_manifest(step3).meta["data_identity"]["key"]["sha256"] == file_sha256(data)
    reader = CheckpointReader(step3)
    cursor = reader.shared()["driver"]["data"]
    reader.close()
    # One step on the new data from its beginning (2 prompts), not the old stream's 3 steps (6 prompts).
    assert (cursor["epoch"], cursor["cursor"]) == (0, 2)
    assert json.loads((run / "summary.json").read_text())["config_changes"]["data_changed"] is True


PLUGIN = '''
CALLS = [0]


def flaky(completions, *, answers, questions, steps):
    CALLS[0] += 1
    if CALLS[0] >= 3:
        raise RuntimeError("the judge is out to lunch")
    return [0.5] * len(completions)


def steady(completions, *, answers, questions, steps):
    return [0.5] * len(completions)
'''


def test_a_raising_reward_plugin_ends_the_run_with_one_line_and_the_last_checkpoint_intact(tmp_path: Path):
    (tmp_path / "plugins").mkdir()
    (tmp_path / "plugins" / "judge.py").write_text(PLUGIN)
    run = tmp_path / "run"
    proc = _train(tmp_path, "experiment.steps=5", "rewards.custom=judge:flaky", pythonpath=str(tmp_path / "plugins"))
    assert proc.returncode == EXIT_PLUGIN_FAILED == 4, proc.stdout[-3000:] + proc.stderr[-3000:]
    failures = [x for x in proc.stderr.splitlines() if "plug-in failed" in x]
    assert len(failures) == 1, proc.stderr
    line = failures[0]
    assert line.startswith("miles-lite train: plug-in failed at step 3/5: reward 'flaky' failed: RuntimeError: "
                           "the judge is out to lunch")
    assert f"traceback in {run / 'logs' / 'run.log'}" in line
    assert line.endswith(f"the run resumes from {run / 'checkpoints' / 'step_00000002'}")
    assert "Traceback" not in proc.stdout + proc.stderr
    log = (run / "logs" / "run.log").read_text()
    assert "Traceback" in log and "judge.py" in log and "the judge is out to lunch" in log
    # Nothing of step 3 saved: the last committed checkpoint (step 2) is intact and the resume point.
    ckpts = run / "checkpoints"
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_00000001", "step_00000002"]
    assert read_latest(ckpts) == "step_00000002"
    verify_checkpoint(ckpts / "step_00000002")
    assert [m["step"] for m in _metrics(run)] == [1, 2]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["plugin_failure"]["plugin"] == "reward 'flaky'" and summary["steps_done"] == 2

    out = _ok(_train(tmp_path, "experiment.steps=5", "rewards.custom=judge:steady",
                     pythonpath=str(tmp_path / "plugins")))
    assert f"resumed from {ckpts / 'step_00000002'} at step 2" in out
    assert [m["step"] for m in _metrics(run)] == [1, 2, 3, 4, 5]


def test_the_offered_fix_resume_none_trains_the_run_over_with_the_new_shape(tmp_path: Path):
    run = tmp_path / "run"
    _ok(_train(tmp_path, "experiment.steps=1"))
    out = _ok(_train(tmp_path, "experiment.steps=1", "model.shape.hidden_size=96", "checkpoint.resume=none"))
    assert "the run's earlier checkpoints step_00000001 were moved to" in out
    # The random initial model is built again with the new shape, and the new checkpoint holds it.
    assert json.loads((run / "initial_model" / "config.json").read_text())["hidden_size"] == 96
    step1 = run / "checkpoints" / "step_00000001"
    assert json.loads((step1 / "hf" / "config.json").read_text())["hidden_size"] == 96
    assert load_manifest(step1).meta["run_config"]["model"]["shape"]["hidden_size"] == 96
    superseded = list((run / "checkpoints" / "superseded").glob("*/step_00000001"))
    assert len(superseded) == 1
    assert "hidden_size: 64" in (run / "config.from_step_0.yaml").read_text()
    assert "hidden_size: 96" in (run / "config.yaml").read_text()
