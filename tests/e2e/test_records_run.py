"""End to end through `miles-lite train`: records with a prompt key and with chat messages, a TRL-style
reward plug-in that checks every column it receives, routing by data source, a None reward, a remote
reward model that receives the columns, an evaluation set and a held-out file evaluated whole, the task's
accuracy per source in the console, metrics, curves and report, `miles-lite eval` on the run with its own
task configuration, and each kind of bad file failing early."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))
from miles_plugins.reward_server import RewardServer  # noqa: E402

from miles_lite.observability.plots import accuracy_lines  # noqa: E402
from miles_lite.observability.rollout_table import read_rollouts  # noqa: E402
from miles_lite.observability.sinks import read_metrics_file  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SHORT = ["observability.progress=false", "experiment.run_name=run", "experiment.warmup=none", "rollout.engines=1",
         "experiment.steps=2", "rollout.prompts_per_step=4", "rollout.group_size=2", "rollout.max_new_tokens=8",
         "algo.drop_zero_signal=false", "rollout.async_steps=0", "data.presample.enabled=false"]

PLUGINS = '''
import asyncio, json, os

def _log(name, **seen):
    with open(os.environ["RECORD_PLUGIN_LOG"], "a") as f:
        f.write(json.dumps({"fn": name, **seen}) + "\\n")

def alpha(prompts, completions, completion_ids, answer_text, metadata, data_source, tests, **kwargs):
    n = len(completions)
    for name, column in (("prompts", prompts), ("completion_ids", completion_ids), ("answer_text", answer_text),
                         ("metadata", metadata), ("data_source", data_source), ("tests", tests)):
        assert len(column) == n, name
    assert all(isinstance(p, str) for p in prompts)
    assert all(isinstance(ids, list) and all(isinstance(t, int) for t in ids) for ids in completion_ids)
    assert all(isinstance(y, str) for y in answer_text)
    assert all(isinstance(m, dict) and isinstance(m["difficulty"], int) for m in metadata)
    assert set(data_source) == {"alpha"}
    assert all(isinstance(t, list) for t in tests)
    _log("alpha", n=n, kwargs=sorted(kwargs), types={"answer_text": type(answer_text[0]).__name__,
         "metadata": type(metadata[0]).__name__, "tests": type(tests[0]).__name__})
    # None for every second completion: not applicable, left out of the mean.
    return [None if i % 2 else float(c.strip() == y) for i, (c, y) in enumerate(zip(completions, answer_text))]

def constant(completions, **kwargs):
    return [1.0] * len(completions)

def parity(completions, data_source, **kwargs):
    return [float(len(c) % 2) for c in completions]

async def beta(completions, data_source, **kwargs):
    await asyncio.sleep(0)
    assert set(data_source) == {"beta"}
    _log("beta", n=len(completions))
    return [min(len(c), 8) / 8 for c in completions]
'''


def _records(n: int, offset: int = 0) -> list[dict]:
    return [{"question": f"echo {chr(97 + (i + offset) % 26)}", "answer_text": chr(97 + (i + offset) % 26),
             "metadata": {"difficulty": i % 3}, "data_source": "alpha" if i % 2 == 0 else "beta",
             "tests": [f"t{i}"]} for i in range(n)]


def _write(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _train(tmp_path: Path, *overrides: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "miles_lite.cli", "train", f"experiment.output_dir={tmp_path / 'out'}",
                           *SHORT, *overrides], capture_output=True, text=True, timeout=800, env=env)


def _plugin_env(tmp_path: Path) -> dict:
    (tmp_path / "plugins").mkdir(exist_ok=True)
    (tmp_path / "plugins" / "record_plugins.py").write_text(PLUGINS)
    path = [str(tmp_path / "plugins"), str(EXAMPLES), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path), "RECORD_PLUGIN_LOG": str(tmp_path / "calls.jsonl")}


def test_records_with_a_prompt_key_routed_by_source_to_trl_style_plugins_and_a_remote_model(tmp_path: Path):
    train = _write(tmp_path / "train.jsonl", _records(8))
    dev = _write(tmp_path / "dev.jsonl", _records(4, offset=8))
    # More records than experiment.eval_size's old default of 64: the held-out file is evaluated whole.
    held = _write(tmp_path / "held.jsonl", _records(70, offset=3))
    server = RewardServer(("127.0.0.1", 0))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        proc = _train(tmp_path, "data.source=records", f"data.train_path={train}", "data.prompt_key=question",
                      "data.label_key=answer_text", "data.metadata_key=metadata", "rewards.set=none",
                      "+rewards.by_source.alpha=record_plugins:alpha", "+rewards.by_source.beta=record_plugins:beta",
                      f"rewards.remote.url={server.url}", "rewards.remote.name=judge", f"data.eval_path={held}",
                      f"+data.eval_sets={{dev: {{path: {dev}, k: 2, temperature: 1.0}}}}", "experiment.eval_every=1",
                      env=_plugin_env(tmp_path))
    finally:
        server.shutdown()
        server.server_close()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    alpha_calls = [c for c in calls if c["fn"] == "alpha"]
    assert alpha_calls and any(c["fn"] == "beta" for c in calls)
    # Every column of the record arrived by its own name, with its type.
    assert all(c["types"] == {"answer_text": "str", "metadata": "dict", "tests": "list"} for c in alpha_calls)
    # The other column, and TRL's trainer state and loggers.
    assert all(c["kwargs"] == ["log_extra", "log_metric", "question", "trainer_state"] for c in alpha_calls)
    run = tmp_path / "out" / "run"
    rows = read_rollouts(run).to_pylist()
    assert len(rows) == 2 * 4 * 2
    labels = {r["question"]: r["answer_text"] for r in _records(8)}
    for row in rows:
        rewards = dict(row["rewards"])
        question = row["prompt"].split("echo ")[1][0]
        assert row["label"] == labels[f"echo {question}"] and row["source"] in ("alpha", "beta")
        other = "beta" if row["source"] == "alpha" else "alpha"
        assert rewards[other] is None and rewards["judge"] is not None
        own = rewards[row["source"]]
        expected = (own or 0.0) + rewards["judge"]
        assert row["total"] == pytest.approx(expected)
    assert any(dict(r["rewards"])["alpha"] is None for r in rows if r["source"] == "alpha")
    steps = read_metrics_file(run)
    assert sum(s.get("reward/none/alpha", 0) for s in steps) > 0
    assert "eval/dev/avg@2" in steps[1] and "eval/dev/pass@2" in steps[1]
    summary = json.loads((run / "summary.json").read_text())
    for phase in ("before", "after"):
        assert set(summary[phase]) == {"eval/dev/reward_mean", "eval/dev/avg@2", "eval/dev/pass@1", "eval/dev/pass@2",
                                       "eval/held_out/reward_mean", "eval/held_out/avg@1", "eval/held_out/pass@1"}
    evaluations = read_metrics_file(run, evaluations=True)
    assert [r["eval_phase"] for r in evaluations] == ["before RL", "after RL"]
    out = proc.stdout + proc.stderr
    assert "set 'held_out' (70 prompts, k=1)" in out and "the first" not in out
    # The task's accuracy (reward at its maximum), overall and per source: console, metrics, curves, report.
    lines = re.findall(r"^step (\d)/2 \| reward [\d.]+ \| accuracy ([\d.]+) \(alpha ([\d.]+), beta ([\d.]+)\) \|",
                       out, re.M)
    assert [line[0] for line in lines] == ["1", "2"], out[-3000:]
    for step, line in zip(steps, lines, strict=True):
        assert all(0.0 <= step[k] <= 1.0 for k in ("reward/accuracy", "reward/accuracy/alpha", "reward/accuracy/beta"))
        assert (f"{step['reward/accuracy']:.2f}", f"{step['reward/accuracy/alpha']:.2f}") == line[1:3]
        assert "reward/mean/alpha" in step and "reward/mean/beta" in step and "reward/exact_accuracy" not in step
    title, curves = accuracy_lines(steps, evaluations)
    assert title == "Accuracy (reward at its maximum)"
    assert {label for label, _, _ in curves} == {"rollouts", "rollouts: alpha", "rollouts: beta", "dev/avg@2",
                                                 "held_out/avg@1"}
    assert dict((label, xs) for label, xs, _ in curves)["held_out/avg@1"] == [0, 1, 2]  # before, after 1 step, after 2
    assert (run / "curves.png").stat().st_size > 1000
    report = subprocess.run([sys.executable, "-m", "miles_lite.cli", "report", str(run)], capture_output=True,
                            text=True, timeout=300)
    assert report.returncode == 0, report.stdout + report.stderr
    html = (run / "report.html").read_text()
    assert "accuracy (reward at its maximum)" in html and "accuracy: alpha" in html and "reward mean: beta" in html
    # The remote reward model got the records' columns too.
    body = server.bodies[0]
    assert set(body["columns"]) == {"question", "answer_text", "metadata", "data_source", "tests"}
    assert all(isinstance(m, dict) for m in body["columns"]["metadata"])
    assert set(body["sources"]) <= {"alpha", "beta"} and all(isinstance(y, str) for y in body["labels"])
    # `miles-lite eval` on the run: its checkpoint, with its own key mapping, rewards and evaluation sets.
    evaluation = subprocess.run(
        [sys.executable, "-m", "miles_lite.cli", "eval", "--log-dir", str(tmp_path / "eval_logs"), str(run),
         "rewards.remote.url=null"], capture_output=True, text=True, timeout=600, env=_plugin_env(tmp_path))
    assert evaluation.returncode == 0, evaluation.stdout[-3000:] + evaluation.stderr[-3000:]
    assert f"{run} (checkpoint step 2), with the run's configuration" in evaluation.stdout
    assert "set 'dev' (4 prompts, k=2)" in evaluation.stdout and "pass@2" in evaluation.stdout
    assert "set 'held_out' (70 prompts, k=1)" in evaluation.stdout
    # A records file evaluated without the records configuration: one line naming the fix.
    plain = subprocess.run([sys.executable, "-m", "miles_lite.cli", "eval", str(run / "initial_model"), str(dev)],
                           capture_output=True, text=True, timeout=300)
    assert plain.returncode == 2 and "Traceback" not in plain.stderr, plain.stderr[-2000:]
    assert "a records file needs data.source=records and its key mapping" in plain.stderr


def test_records_with_chat_messages_and_an_sft_warm_up_on_their_responses(tmp_path: Path):
    rows = [{"messages": [{"role": "system", "content": "Reply with the letter."},
                          {"role": "user", "content": f"letter {c}"}], "label": c, "ref": f"answer: {c}"}
            for c in "abcdefgh"]
    train = _write(tmp_path / "train.jsonl", rows)
    proc = _train(tmp_path, "data.source=records", f"data.train_path={train}", "data.messages_key=messages",
                  "data.response_key=ref", "rewards.set=exact_match", r"rewards.answer_pattern='answer:\s*(\w)'",
                  "experiment.warmup=sft", "experiment.warmup_steps=3", "experiment.warmup_batch_size=4",
                  "experiment.warmup_exclude_from_rl=false", "experiment.warmup_demos=0",
                  "data.presample.enabled=true", "data.presample.k=2",
                  "experiment.steps=1")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = tmp_path / "out" / "run"
    table = read_rollouts(run).to_pylist()
    assert len(table) == 4 * 2
    for row in table:
        # Rendered with the tokenizer's chat template (ChatML), the record's own system message first.
        assert row["prompt"].startswith("<|im_start|>system\nReply with the letter.<|im_end|>\n<|im_start|>user\n")
        assert row["prompt"].endswith("<|im_start|>assistant\n")
        assert set(dict(row["rewards"])) == {"exact_match"} and row["label"] in "abcdefgh"
    assert len((run / "warmup.jsonl").read_text().splitlines()) == 3
    # Presampled by reward == the reward's maximum: every record, k samples each.
    presample = json.loads((run / "presample.json").read_text())
    assert presample["k"] == 2 and len(presample["results"]) == 8
    assert all(0 <= r["strict"] == r["lenient"] <= 2 for r in presample["results"])


def test_dynamic_sampling_refills_zero_signal_groups_of_records(tmp_path: Path):
    train = _write(tmp_path / "train.jsonl", _records(16))
    proc = _train(tmp_path, "data.source=records", f"data.train_path={train}", "data.prompt_key=question",
                  "data.label_key=answer_text", "rewards.set=none", "+rewards.by_source.alpha=record_plugins:parity",
                  "+rewards.by_source.beta=record_plugins:constant", "rollout.dynamic_sampling=true",
                  "rollout.group_size=4", env=_plugin_env(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = tmp_path / "out" / "run"
    steps = read_metrics_file(run)
    # Every "beta" group scores 1.0 throughout (zero signal): dropped and replaced by fresh records.
    assert sum(s["rollout/dropped_groups"] for s in steps) > 0 and sum(s["rollout/refill_prompts"] for s in steps) > 0
    rows = read_rollouts(run).to_pylist()
    assert rows and {r["source"] for r in rows} == {"alpha"}
    by_group: dict = {}
    for row in rows:
        by_group.setdefault((row["step"], row["prompt_index"]), []).append(row["total"])
    assert all(len(t) == 4 and len(set(t)) > 1 for t in by_group.values())


BAD_FILES = [
    ({"prompt": "p"}, {}, r"train.jsonl: line 2: missing key 'label' \(data.label_key\)"),
    ({"prompt": ["p"], "label": "x"}, {},
     r"train.jsonl: line 2: key 'prompt' \(data.prompt_key\) message 0 must be an object"),
    ({"prompt": "", "label": "x"}, {}, r"train.jsonl: line 2: key 'prompt' \(data.prompt_key\) is empty"),
    ("{oops", {}, r"train.jsonl: line 2: invalid JSON"),
    ({"prompt": "p", "label": "x", "meta": "no"}, {"data.metadata_key": "meta"},
     r"line 2: key 'meta' \(data.metadata_key\) must be an object"),
    ({"prompt": "p", "label": "x", "data_source": "gamma"}, {"rewards.set": "none", "+rewards.by_source.alpha":
                                                                 "record_plugins:constant"},
     r"train.jsonl: line 2: data source 'gamma' has no reward function; add rewards.by_source.gamma"),
    ({"prompt": "p", "label": "x"}, {"rewards.set": "worklog"},
     r"train.jsonl: line 2: label 'x' is not a number, which the math rewards"),
    ({"prompt": "p", "label": "x"}, {"rewards.set": "none", "rewards.custom": "record_plugins:alpha"},
     r"reward 'alpha' cannot score data.train_path: it asks for \['answer_text', 'metadata', 'data_source', 'tests'\]"),
]


@pytest.mark.parametrize(("second", "overrides", "message"), BAD_FILES,
                         ids=["missing-key", "wrong-type", "empty-prompt", "invalid-json", "metadata-type",
                              "source-without-reward", "math-reward-string-label", "plugin-column-missing"])
def test_bad_records_fail_before_any_work(tmp_path: Path, second, overrides: dict, message: str):
    first = {"prompt": "fine", "label": "1" if overrides.get("rewards.set") == "worklog" else "x"}
    if "data.metadata_key" in overrides:
        first["meta"] = {}
    if "+rewards.by_source.alpha" in overrides:
        first["data_source"] = "alpha"
    train = _write(tmp_path / "train.jsonl", [first, second])
    extra = [f"{k}={v}" for k, v in overrides.items()]
    reward_set = [] if "rewards.set" in overrides else ["rewards.set=exact_match"]
    proc = _train(tmp_path, "data.source=records", f"data.train_path={train}", "data.prompt_key=prompt",
                  *reward_set, *extra, env=_plugin_env(tmp_path))
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    import re

    assert re.search(message, proc.stderr), proc.stderr
    assert not (tmp_path / "out").exists()


def test_more_demonstrations_than_records_fails_before_any_work(tmp_path: Path):
    train = _write(tmp_path / "train.jsonl", [{"prompt": "p", "label": "x", "ref": "x"}])
    proc = _train(tmp_path, "data.source=records", f"data.train_path={train}", "data.prompt_key=prompt",
                  "data.response_key=ref", "rewards.set=exact_match", "experiment.warmup=sft")
    assert proc.returncode == 2 and "experiment.warmup_demos=96 asks for more demonstrations than the 1" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_a_bad_evaluation_set_fails_before_any_work(tmp_path: Path):
    train = _write(tmp_path / "train.jsonl", [{"prompt": "p", "label": "x"}])
    dev = _write(tmp_path / "dev.jsonl", [{"prompt": "p", "label": "x"}, {"label": "y"}])
    proc = _train(tmp_path, "data.source=records", f"data.train_path={train}", "data.prompt_key=prompt",
                  "rewards.set=exact_match", f"+data.eval_sets={{dev: {{path: {dev}}}}}")
    assert proc.returncode == 2 and "dev.jsonl: line 2: missing key 'prompt' (data.prompt_key)" in proc.stderr
    assert not (tmp_path / "out").exists()
