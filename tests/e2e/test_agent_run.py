"""End to end through `miles-lite train` with an agent written against the real `openai` client
(`agent_probe.py`): every session is three turns with tool results; its ids equal, turn by turn, the ids the
reference engines recorded receiving and producing; a diverging history is refused (400) and counted; a request
without the session's key gets 401; an engine SIGKILLed mid-session moves the session to the other engine and
its sample stays exact; a 2-second blocking tool in one agent delays no other."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from miles_lite.observability.rollout_table import read_rollouts
from miles_lite.observability.sinks import read_metrics_file

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
HERE = Path(__file__).resolve().parent


ROLES = ["plain", "plain", "kill", "slow", "diverge", "keyless"]


def _records(path: Path) -> None:
    lines = [{"messages": [{"role": "system", "content": "Use the tool."}, {"role": "user", "content": f"q{i}"}],
              "label": "x", "metadata": {"role": role}} for i, role in enumerate(ROLES)]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))


def test_agent_sessions_through_miles_lite_train_are_token_exact_and_survive_faults(tmp_path: Path):
    (tmp_path / "claims").mkdir()
    _records(tmp_path / "records.jsonl")
    engine_log = tmp_path / "engine_requests.jsonl"
    env = {**os.environ, "AGENT_TEST_DIR": str(tmp_path / "claims"),
           "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-m", "miles_lite.cli", "train", f"experiment.output_dir={tmp_path}",
         "experiment.run_name=run", "observability.progress=false", "experiment.warmup=none", "experiment.steps=1",
         "data.source=records", f"data.train_path={tmp_path / 'records.jsonl'}", "data.messages_key=messages",
         "data.metadata_key=metadata", "data.presample.enabled=false", "experiment.eval_size=0",
         "rewards.set=none", "rollout.agent=agent_probe:probe", "rollout.chat_template=qwen2.5",
         "rollout.engines=2", "rollout.prompts_per_step=6", "rollout.group_size=2", "rollout.max_new_tokens=120",
         "rollout.async_steps=0", "algo.drop_zero_signal=false", "fault_tolerance.request_retries=4",
         "fault_tolerance.failure_threshold=1", "fault_tolerance.health_interval_s=0.5",
         f"+rollout.reference_args.record_requests={engine_log}"],
        capture_output=True, text=True, timeout=500, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = read_rollouts(tmp_path / "run").to_pylist()
    agents = [json.loads(r["agent"]) for r in rows]
    assert len(agents) == 12 and {a["role"] for a in agents} == set(ROLES)
    served = [json.loads(line) for line in engine_log.read_text().splitlines()]
    seen = {(tuple(r["input_ids"]), tuple(r["output_ids"])) for r in served}
    for row, agent in zip(rows, agents, strict=True):
        turns, record = agent["turns"], agent["record"]
        ids = record["prompt_ids"] + record["response_ids"]
        assert row["turns"] == record["turns"] == 3 and row["length"] == len(record["response_ids"])
        for t, turn in enumerate(turns):
            # The engine received exactly the session's ids so far and produced exactly what the session holds.
            assert (tuple(turn["input"]), tuple(turn["output"])) in seen
            assert ids[:len(turn["input"]) + len(turn["output"])] == turn["input"] + turn["output"]
            if t:
                prev = turns[t - 1]
                assert turn["input"][:len(prev["input"]) + len(prev["output"])] == prev["input"] + prev["output"]
            start = len(turn["input"]) - len(record["prompt_ids"])
            assert record["loss_mask"][start:start + len(turn["output"])] == [1] * len(turn["output"])
        assert ids == turns[-1]["input"] + turns[-1]["output"]
        assert sum(record["loss_mask"]) == sum(len(t["output"]) for t in turns)
        # Step 1's sessions ran on the weights RL starts from: version 0 (docs/observability.md).
        assert record["weight_version"] == row["weight_version"] == "0"
    by_role = {role: [a for a in agents if a["role"] == role] for role in ROLES}
    assert all(a["diverged"][0] == 400 and "messages[1] (user) differs" in a["diverged"][1]
               for a in by_role["diverge"])
    assert all(a["keyless"] == 401 for a in by_role["keyless"])
    (killer,) = [a for a in by_role["kill"] if "killed" in a]
    assert killer["turns"][0]["engine"] != killer["turns"][1]["engine"] == killer["turns"][2]["engine"]
    assert killer["record"]["engine_moves"] == 1
    # While the slow agent's tool blocked for 2 s, the other agents' turns went on: the plain ones finished
    # inside that window.
    (slow_start, slow_end), *_ = [a["slow"] for a in by_role["slow"]]
    assert all(a["done"] < slow_end for a in by_role["plain"] + by_role["keyless"]), (slow_start, slow_end)
    (step,) = read_metrics_file(tmp_path / "run")
    assert step["rollout/agents_started"] == 12 and step["rollout/agents_failed"] == 0
    assert step["rollout/session_diverged"] == 2 and step["rollout/session_engine_moves"] >= 1
    assert step["rollout/agent_turns_per_sample"] == 3.0 and step["algo/trained_sequences"] == 12
