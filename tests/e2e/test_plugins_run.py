"""End to end: a `miles-lite train` run scoring with a plug-in reward function (by import path) and a
remote reward model behind a real HTTP server, beside the rule-based rewards, with dynamic sampling
filtered by a plug-in group filter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))
from miles_plugins.reward_server import RewardServer  # noqa: E402

from miles_lite.observability.rollout_table import read_rollouts  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SHORT = ["data.presample.enabled=false", "rollout.prompts_per_step=4", "rollout.group_size=4",
         "data.synthetic.eval_size=4", "observability.progress=false", "experiment.run_name=run",
         "experiment.warmup=none", "rollout.engines=1", "experiment.steps=2",
         # Every group trains (the embedded default leaves zero-signal groups out), so every step has train stats.
         "algo.drop_zero_signal=false", "rollout.async_steps=0"]


def test_run_scores_with_plugin_rewards_a_remote_reward_model_and_a_group_filter(tmp_path: Path):
    # The first request fails (HTTP 503): the run retries it and goes on.
    server = RewardServer(("127.0.0.1", 0), fail_first=1)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    # A group filter that is easy to see in the output: only even prompt indices are trained on.
    (tmp_path / "plugins").mkdir()
    (tmp_path / "plugins" / "parity_filter.py").write_text(
        "def even_prompts(group):\n    return group.prompt_index % 2 == 0\n")
    path = [str(EXAMPLES), str(tmp_path / "plugins"), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "miles_lite.cli", "train", f"experiment.output_dir={tmp_path}", *SHORT,
             "rewards.set=correctness_only", "rewards.custom=miles_plugins.rewards:brevity",
             "+rewards.weights.brevity=0.25",
             f"rewards.remote.url={server.url}", "rewards.remote.name=judge", "rewards.remote.weight=2.0",
             "rewards.remote.batch_size=5", "rewards.remote.backoff_s=0.05",
             "rollout.dynamic_sampling=true", "rollout.group_filter=parity_filter:even_prompts"],
            capture_output=True, text=True, timeout=800, env=env)
    finally:
        server.shutdown()
        server.server_close()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = read_rollouts(tmp_path / "run").to_pylist()
    assert table and all(row["prompt_index"] % 2 == 0 for row in table)
    for row in table:
        rewards = dict(row["rewards"])
        assert set(rewards) == {"correctness_check", "brevity", "judge"}
        assert rewards["judge"] in (0.0, 1.0)
        expected = rewards["correctness_check"] + 0.25 * rewards["brevity"] + 2.0 * rewards["judge"]
        assert row["total"] == pytest.approx(expected)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    dropped = sum(r["rollout/dropped_groups"] for r in records)
    assert dropped > 0
    # Every completion generated (kept or dropped by the filter) was scored by the service exactly once; the
    # failed first request scored nothing.
    assert len(server.scored_ids) == len(table) + 4 * dropped == len(set(server.scored_ids))
    assert server.requests >= 2


FORCED_PREFIX_PLUGIN = '''
from dataclasses import replace

from miles_lite.rollout.generate_plugin import GenerateResult

PREFIX = "<start_working_out>"


async def forced_prefix(client, prompt, sampling):
    """Write the working-out tag for the model (masked out of the loss), then let it continue."""
    prefix = client.encode(PREFIX)
    rest = await client.generate([*prompt.prompt_ids, *prefix],
                                 replace(sampling, max_new_tokens=sampling.max_new_tokens - len(prefix)))
    ids = [*prefix, *rest.output_ids]
    return GenerateResult(ids, [0.0] * len(prefix) + list(rest.output_logprobs),
                          [0] * len(prefix) + [1] * len(rest.output_ids), rest.finish_reason)
'''


def test_run_with_a_generate_plugin_trains_only_on_the_models_tokens(tmp_path: Path):
    (tmp_path / "plugins").mkdir()
    (tmp_path / "plugins" / "prefix_plugin.py").write_text(FORCED_PREFIX_PLUGIN)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "plugins"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-m", "miles_lite.cli", "train", f"experiment.output_dir={tmp_path}", *SHORT,
         "rollout.generate_fn=prefix_plugin:forced_prefix"],
        capture_output=True, text=True, timeout=800, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = read_rollouts(tmp_path / "run").to_pylist()
    assert len(table) == 2 * 4 * 4
    assert all(row["completion"].startswith("<start_working_out>") for row in table)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    # The tag is one token of the offline tokenizer: each trained sequence has one token out of the loss.
    for record in records:
        assert record["response_tokens"] - record["loss_tokens"] == record["algo/trained_sequences"] > 0


def test_calculator_experiment_calls_the_tool_and_rl_raises_held_out_accuracy(tmp_path: Path):
    """`experiment=tiny_cpu_tools` as a user runs it (seed 0): after the SFT warm-up in the tool format every
    held-out answer calls the calculator; every reply in the rollout table is the calculator's value of the
    call before it and stays out of the loss; RL raises held-out exact accuracy by more than 3 standard
    errors (docs/benchmarks.md: seed 0 +14.2 to +14.8 points, 4.5-4.7 SE, over three runs)."""
    import math
    import re

    from miles_lite.data.calculator import Calculator

    proc = subprocess.run(
        [sys.executable, "-m", "miles_lite.cli", "train", "experiment=tiny_cpu_tools",
         f"experiment.output_dir={tmp_path}", "experiment.run_name=run", "observability.progress=false"],
        capture_output=True, text=True, timeout=800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    before, after = summary["before"], summary["after"]
    n = before["n"]
    se = math.sqrt((before["exact"] * (1 - before["exact"]) + after["exact"] * (1 - after["exact"])) / n)
    assert after["exact"] - before["exact"] > 3 * se, (before, after)
    assert before["tool_calls"] >= 0.9 and after["tool_calls"] >= 0.9
    table = read_rollouts(tmp_path / "run").to_pylist()
    multi = [row for row in table if row["turns"] >= 2]
    assert len(multi) >= 0.9 * len(table), [row["completion"] for row in table[:4]]
    calls = 0
    for row in multi:
        for call in re.finditer(r"(.*?<calc>.*?</calc>)(<result>.*?</result>)", row["completion"], re.S):
            assert Calculator().reply(call.group(1), "") == call.group(2)
            calls += 1
    assert calls >= len(multi)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    # The policy keeps calling the tool through RL: over the run, and in every step up to sampling noise (a step's
    # share is over its few dozen samples: one run had a step below 0.9, another none below 0.953).
    shares = [r["rollout/tool_use_share"] for r in records]
    assert sum(shares) / len(shares) >= 0.95 and min(shares) >= 0.8, sorted(shares)[:5]
    assert all(r["loss_tokens"] < r["response_tokens"] for r in records if r["algo/trained_sequences"])
