"""A TRL user's data and reward functions, unchanged, through `miles-lite train`: TRL's shipped rewards (and
its factories, called with their arguments) on conversational records from a `datasets` save_to_disk folder
and on raw string prompts from Parquet shards by glob; evaluation data from `Dataset.to_json`, a JSON array and
an `.arrow` file (a list of files, in order); a
reward that reads `trainer_state` and logs with `log_metric` / `log_extra`; a bare factory refused before any
work with the call to write."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from datasets import Dataset

from miles_lite.observability.rollout_table import read_rollouts
from miles_lite.observability.sinks import read_metrics_file

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SHORT = ["observability.progress=false", "experiment.run_name=run", "experiment.warmup=none", "rollout.engines=1",
         "experiment.steps=2", "rollout.prompts_per_step=4", "rollout.group_size=2", "rollout.max_new_tokens=8",
         "algo.drop_zero_signal=false", "rollout.async_steps=0", "data.presample.enabled=false"]

PLUGIN = '''
def progress(prompts, completions, trainer_state, log_metric, log_extra, **kwargs):
    """A user's reward in TRL's convention: reads the trainer state, logs a metric and a column."""
    share = trainer_state.global_step / trainer_state.max_steps
    log_metric("progress", share)
    log_extra("kind", ["chat" if isinstance(p, list) else "text" for p in prompts])
    return [share] * len(completions)
'''


def _train(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    (tmp_path / "plugins").mkdir(exist_ok=True)
    (tmp_path / "plugins" / "my_rewards.py").write_text(PLUGIN)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "plugins"), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "miles_lite.cli", "train", f"experiment.output_dir={tmp_path / 'out'}",
                           *SHORT, *overrides], capture_output=True, text=True, timeout=800, env=env)


def _chat(i: int) -> dict:
    return {"prompt": [{"role": "developer", "content": [{"type": "text", "text": "Answer in a box."}]},
                       {"role": "user", "content": [{"type": "text", "text": f"What is {i} + 1?"}]}],
            "solution": str(i + 1)}


def test_trl_rewards_on_conversational_records_from_a_datasets_folder(tmp_path: Path):
    Dataset.from_list([_chat(i) for i in range(8)]).save_to_disk(str(tmp_path / "train"))
    Dataset.from_list([_chat(i) for i in range(10, 12)]).to_json(tmp_path / "dev.json")  # JSON Lines in .json
    (tmp_path / "more.json").write_text(json.dumps([_chat(12)], indent=1))  # one JSON array
    held_out = f'data.eval_path=["{tmp_path / "dev.json"}","{tmp_path / "more.json"}"]'  # several files, in order
    proc = _train(tmp_path, "data.source=records", f"data.train_path={tmp_path / 'train'}", "data.prompt_key=prompt",
                  held_out, "experiment.eval_size=3", "rewards.set=none",
                  "rewards.custom=[trl.rewards:accuracy_reward, trl.rewards:think_format_reward,"
                  " trl.rewards:reasoning_accuracy_reward,"
                  " 'trl.rewards:get_soft_overlong_punishment(max_completion_len=8, soft_punish_cache=4)',"
                  " {fn: trl.rewards:get_cosine_scaled_reward, kwargs: {max_len: 8}},"
                  " my_rewards:progress]",
                  "+rewards.weights.soft_overlong_punishment_reward=0.5")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = tmp_path / "out" / "run"
    rows = read_rollouts(run).to_pylist()
    assert len(rows) == 2 * 4 * 2
    names = {"accuracy_reward", "think_format_reward", "reasoning_accuracy_reward", "soft_overlong_punishment_reward",
             "cosine_scaled_reward", "progress"}
    for row in rows:
        rewards = dict(row["rewards"])
        assert set(rewards) == names and rewards["soft_overlong_punishment_reward"] in (0.0, -0.25, -0.5, -0.75, -1.0)
        # The developer turn is rendered as the template renders system (ChatML), typed parts joined.
        assert row["prompt"].startswith("<|im_start|>system\nAnswer in a box.<|im_end|>\n<|im_start|>user\nWhat is ")
        extra = dict(row["extra"])
        # accuracy_reward's log_extra columns and the user's: one value per completion.
        assert extra["kind"] == "chat" and "gold_parsed" in extra and extra["solution"] == str(int(row["prompt"]
                                                                                                   .split("is ")[1]
                                                                                                   .split(" ")[0]) + 1)
        assert rewards["progress"] == (row["step"] - 1) / 2  # trainer_state.global_step: the steps done before
    steps = read_metrics_file(run)
    assert [s["log_metric/progress"] for s in steps] == [0.0, 0.5]
    summary = json.loads((run / "summary.json").read_text())
    assert "eval/held_out/avg@1" in summary["before"] and "eval/held_out/avg@1" in summary["after"]
    assert "set 'held_out' (3 prompts, k=1)" in proc.stdout + proc.stderr  # both files read


def test_trl_rewards_on_raw_string_prompts_from_parquet_shards(tmp_path: Path):
    rows = [{"prompt": f"Count: {'a ' * (i % 4 + 1)}", "difficulty": i % 4} for i in range(8)]
    for shard in range(2):
        Dataset.from_list(rows[shard::2]).to_parquet(tmp_path / f"train-{shard:05d}-of-00002.parquet")
    dev = Dataset.from_list(rows[:3])
    dev.save_to_disk(str(tmp_path / "dev"))
    arrow = next((tmp_path / "dev").glob("*.arrow"))
    proc = _train(tmp_path, "data.source=records", f"data.train_path={tmp_path}/train-*-of-00002.parquet",
                  "data.prompt_key=prompt", "data.chat_template=false", "rewards.set=none",
                  "rewards.custom=['trl.rewards:get_repetition_penalty_reward(ngram_size=2)', my_rewards:progress]",
                  f"+data.eval_sets={{dev: {{path: {arrow}, k: 2, temperature: 1.0}}}}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = tmp_path / "out" / "run"
    table = read_rollouts(run).to_pylist()
    prompts = {r["prompt"] for r in rows}
    for row in table:
        # Fed as written: no chat template around it (the project's tokenizer adds no BOS).
        assert row["prompt"] in prompts and dict(row["extra"]) == {"kind": "text"}
        assert -1.0 <= dict(row["rewards"])["repetition_penalty_reward"] <= 0.0
    summary = json.loads((run / "summary.json").read_text())
    # The penalty's best is 0 (undeclared: the best over the set's samples), so a set can be passed.
    assert "eval/dev/pass@2" in summary["after"]


def test_a_factory_named_bare_is_refused_with_the_call_to_write(tmp_path: Path):
    Dataset.from_list([{"prompt": "p"}]).to_json(tmp_path / "t.json")
    proc = _train(tmp_path, "data.source=records", f"data.train_path={tmp_path / 't.json'}", "data.prompt_key=prompt",
                  "rewards.set=none", "rewards.custom=trl.rewards:get_soft_overlong_punishment")
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert ("rewards.custom='trl.rewards:get_soft_overlong_punishment(max_completion_len=..., soft_punish_cache=...)'"
            in proc.stderr), proc.stderr
    assert not (tmp_path / "out").exists()
