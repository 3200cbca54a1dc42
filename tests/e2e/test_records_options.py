"""Options that must do what they say, on one short records run through `miles-lite train`: presample scoring
strict vs lenient on partial-credit rewards, a k > 1 evaluation set sampling at the run's temperature, the
TensorBoard and W&B (offline) sinks; then a resume with another `data.prompt_key` refused naming the key, and a
reward that returns None for every completion ending the run (exit 4) instead of training on nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from miles_lite.observability.sinks import read_metrics_file
from miles_lite.run.failure import EXIT_PLUGIN_FAILED

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

PLUGINS = '''
def thirds(completions, **kwargs):
    # Partial credit: 0, 0.5 or 1 by the completion's length (the tiny random model's completions vary).
    return [(len(c) % 3) / 2 for c in completions]

def never(completions, **kwargs):
    return [None] * len(completions)
'''

SHORT = ["observability.progress=false", "experiment.warmup=none", "rollout.engines=1", "rollout.async_steps=0",
         "rollout.prompts_per_step=3", "rollout.group_size=2", "rollout.max_new_tokens=6", "data.source=records",
         "data.prompt_key=q", "data.label_key=a", "rewards.set=none", "algo.drop_zero_signal=false"]


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _train(root: Path, *overrides: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "plugins"), os.environ.get("PYTHONPATH", "")]),
           "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    return subprocess.run([sys.executable, "-m", "miles_lite.cli", "train", f"experiment.output_dir={root / 'out'}",
                           *SHORT, *overrides], capture_output=True, text=True, timeout=800, env=env)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("records_options")
    (root / "plugins").mkdir()
    (root / "plugins" / "option_plugins.py").write_text(PLUGINS)
    rows = [{"q": f"echo {c}", "q2": f"say {c}", "a": c} for c in "abcdefgh"]
    train = _write(root / "train.jsonl", rows)
    dev = _write(root / "dev.jsonl", rows[:6])
    common = [f"data.train_path={train}", "rewards.custom=option_plugins:thirds", "experiment.run_name=run"]
    proc = _train(root, *common, "experiment.steps=1", "data.presample.enabled=true", "data.presample.k=4",
                  "data.presample.scoring=strict", f"+data.eval_sets={{dev: {{path: {dev}, k: 4}}}}",
                  "observability.tensorboard=true", "observability.wandb=true", "observability.wandb_project=opts")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {"root": root, "run": root / "out" / "run", "common": common, "log": proc.stdout + proc.stderr}


def test_presample_scoring_of_records_means_strict_or_lenient(run: dict[str, Any]) -> None:
    report = json.loads((run["run"] / "presample.json").read_text())
    results = report["results"]
    assert report["scoring"] == "strict" and len(results) == 8 and all(r["k"] == 4 for r in results)
    # strict: full marks (1.0); lenient: any credit (0.5 or 1.0). Partial credit makes them differ.
    assert all(r["lenient"] >= r["strict"] for r in results)
    assert any(r["lenient"] > r["strict"] for r in results)
    assert report["pass_lenient"][0] > report["pass_strict"][0]
    # The filter used the strict counts.
    kept = {r["index"] for r in results if 0 < r["strict"] < 4}
    assert set(report["kept_indices"]) == kept
    assert f"presample (strict): {report['all_wrong']} questions 0/4" in run["log"]


def test_a_k_sample_evaluation_set_samples_at_the_runs_temperature(run: dict[str, Any]) -> None:
    before = [r for r in read_metrics_file(run["run"], evaluations=True) if r.get("eval/dev/avg@4") is not None]
    assert before, "the evaluation set reported nothing"
    first = before[0]
    # Four greedy samples would be one answer four times: pass@4 would equal avg@4 (each prompt 0/4 or 4/4).
    assert first["eval/dev/pass@4"] > first["eval/dev/avg@4"]
    assert first["eval/dev/pass@1"] == pytest.approx(first["eval/dev/avg@4"])


def test_tensorboard_sink_writes_the_steps_scalars(run: dict[str, Any]) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run["run"] / "tensorboard"))
    events.Reload()
    tags = events.Tags()["scalars"]
    assert "reward/mean" in tags and "grad_norm" in tags
    (point,) = events.Scalars("reward/mean")
    (step,) = read_metrics_file(run["run"])
    assert point.value == pytest.approx(step["reward/mean"]) and point.step == step["step"]


def test_wandb_sink_logs_the_run_offline(run: dict[str, Any]) -> None:
    (offline,) = (run["run"] / "wandb").glob("offline-run-*")
    (data,) = offline.glob("run-*.wandb")
    body = data.read_bytes()
    # W&B's offline record of the run: its name, project, configuration and the steps' scalars.
    for text in (b"run", b"opts", b"reward/mean", b"grad_norm", b"option_plugins:thirds"):
        assert text in body, text


def test_resume_with_another_prompt_key_is_refused_naming_the_key(run: dict[str, Any]) -> None:
    proc = _train(run["root"], *run["common"], "experiment.steps=2", "data.prompt_key=q2",
                  "data.presample.enabled=false")
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "data (data.prompt_key): the checkpoint's prompt cursor indexes" in proc.stderr
    assert "read with data.prompt_key=q, data.label_key=a (asked: " in proc.stderr
    assert "read with data.prompt_key=q2, data.label_key=a)" in proc.stderr


def test_a_reward_that_never_applies_ends_the_run_instead_of_training_on_nothing(run: dict[str, Any]) -> None:
    proc = _train(run["root"], f"data.train_path={run['root'] / 'train.jsonl'}", "rewards.custom=option_plugins:never",
                  "experiment.run_name=never", "experiment.steps=2", "data.presample.enabled=false",
                  "experiment.eval_size=0")
    assert proc.returncode == EXIT_PLUGIN_FAILED, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert ("reward 'never' failed: ValueError: returned None for all 6 completions of the step: none was scored"
            in proc.stderr)
    assert "at step 1/2" in proc.stderr
    assert not (run["root"] / "out" / "never" / "metrics.jsonl").is_file() or not read_metrics_file(
        run["root"] / "out" / "never")
