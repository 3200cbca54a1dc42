"""End to end on the embedded default, shortened: one-step-off async rollouts, a rollout engine SIGKILLed
mid-training, and the on-policy-distillation warm-up from a teacher whose vocabulary has padding rows."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

# Short runs: no presample, small batches, a tiny held-out set, no progress bar.
SHORT = ["data.presample.enabled=false", "rollout.prompts_per_step=4", "rollout.group_size=4",
         "data.synthetic.eval_size=4", "observability.progress=false", "experiment.run_name=run"]


def _train_cmd(tmp_path: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "miles_lite.cli", "train", f"experiment.output_dir={tmp_path}", *SHORT, *overrides]


def _run(tmp_path: Path, *overrides: str) -> Path:
    proc = subprocess.run(_train_cmd(tmp_path, *overrides), capture_output=True, text=True, timeout=1100)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return tmp_path / "run"


def _records(run: Path) -> list[dict[str, Any]]:
    path = run / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def test_one_step_off_async_run_reports_staleness_and_mixed_versions(tmp_path: Path):
    run = _run(tmp_path, "experiment.steps=3", "experiment.warmup=none", "rollout.engines=1",
               "rollout.async_steps=1", "rollout.max_staleness=1")
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps_done"] == 3 and not summary["stopped_by_signal"]
    records = _records(run)
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        for key in ("rollout/stale_dropped", "rollout/mixed_version_samples", "rollout/pauses"):
            assert r[key] >= 0, key
        assert r["rollout/stale_dropped"] == 0  # one step behind is within max_staleness=1
        assert r["rollout/mixed_version_samples"] <= r["rollout/resumed_partials"]
    # Step 1 generates on the current weights. Every later step's generation started while the previous
    # step trained: it finished on the old weights (one version behind) or was paused by the push.
    assert records[0]["rollout/staleness_max"] == 0 and records[0]["rollout/pauses"] == 0
    for r in records[1:]:
        assert r["rollout/staleness_max"] in (0.0, 1.0)
        assert r["rollout/staleness_max"] == 1.0 or r["rollout/pauses"] >= 1, r
    assert len(list((run / "rollouts").iterdir())) == 3
    # Weight version = RL steps the weights had taken: step 1 came from version 0; step k's samples came from
    # version k - 2 (generated while step k - 1 trained) or, paused by the push, straddle it ("k-2+k-1"), or
    # from version k - 1; none from a version ahead.
    from miles_lite.observability.rollout_table import read_rollouts

    table = read_rollouts(run).to_pylist()
    assert {r["weight_version"] for r in table if r["step"] == 1} == {"0"}
    for step in (2, 3):
        assert {r["weight_version"] for r in table if r["step"] == step} <= {str(step - 2), f"{step - 2}+{step - 1}",
                                                                            str(step - 1)}, step


def _children(pid: int) -> list[tuple[int, str]]:
    """(pid, command line) of the direct children of `pid`, read from /proc."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:  # the process ended while we looked
            continue
        # Field 4 is the parent pid; the command name before it may contain spaces, so split after ')'.
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            out.append((int(entry.name), cmdline))
    return out


def _wait(condition: Any, timeout_s: float, what: str, proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if proc.poll() is not None:
            raise AssertionError(f"the run exited ({proc.returncode}) before {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(0.2)  # poll interval of the condition above


def test_engine_sigkilled_mid_training_is_replaced_and_the_run_completes(tmp_path: Path):
    # Far more steps than needed: the run trains on one engine while the replacement starts (a few
    # seconds, however fast the steps are), and is stopped with SIGTERM once a step shows both slots
    # serving again, which also checks the graceful stop.
    steps = 1000
    cmd = _train_cmd(tmp_path, f"experiment.steps={steps}", "experiment.warmup=none", "rollout.engines=2",
                     "rollout.prompts_per_step=2", "rollout.max_new_tokens=32",
                     "fault_tolerance.health_interval_s=0.5", "fault_tolerance.failure_threshold=2",
                     "fault_tolerance.max_engine_restarts=2", "fault_tolerance.request_retries=4",
                     "rollout.request_timeout_s=60")
    log = (tmp_path / "driver.log").open("w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)
    run = tmp_path / "run"

    def readmitted() -> bool:
        last = (_records(run) or [{}])[-1]
        return last.get("fleet/restarts", 0) >= 1 and last.get("fleet/engines_healthy") == 2

    try:
        _wait(lambda: len(_records(run)) >= 1, 900, "the first RL step", proc)
        engines = [(pid, cmd) for pid, cmd in _children(proc.pid) if "miles_lite.engines.reference.engine" in cmd]
        assert len(engines) == 2, engines
        victim = engines[0][0]
        os.kill(victim, signal.SIGKILL)
        _wait(readmitted, 600, "a step with the replacement admitted", proc)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=300) == 0, (tmp_path / "driver.log").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["stopped_by_signal"] and summary["steps_done"] < steps
    console = (tmp_path / "driver.log").read_text()
    assert "is dead" in console and "replacement admitted after push" in console  # the user sees the events
    records = _records(run)
    assert [r["step"] for r in records] == list(range(1, summary["steps_done"] + 1)), "every step ran, none twice"
    during = [r for r in records if r["fleet/restarts"] >= 1 and r["fleet/engines_healthy"] == 1]
    assert during, "some steps trained on the survivor alone while the replacement started"
    # The replacement came up stale and was admitted by a later push: both slots serve again.
    last = records[-1]
    assert last["fleet/restarts"] >= 1 and last["fleet/engines_healthy"] == 2 and last["fleet/engines_dead"] == 0
    assert all(r["sync/probe_logp_diff_mean"] < 1e-3 for r in records)


def _make_teacher(out: Path) -> Path:
    """A teacher with a known distribution: in every context it prefers the even token ids (logit +3 over
    the odd ones), and its 64 extra vocabulary rows (padding, as real checkpoints have) get logit +10,
    which would swamp every real token unless the trainer trims the teacher's softmax to the student's
    512 tokens. Built as a tiny Qwen2 whose hidden state is the same vector at every position."""
    import dataclasses

    import torch

    from miles_lite.config.schema import TinyModelShape
    from miles_lite.trainer.tiny_hf import build_tiny_hf_model

    shape = dataclasses.replace(TinyModelShape(), tie_word_embeddings=False)
    model = build_tiny_hf_model("qwen2", shape, 512 + 64, seed=3)
    with torch.no_grad():
        for layer in model.model.layers:  # blocks add nothing to the residual stream
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb = model.model.embed_tokens.weight
        emb.copy_(emb[0].expand_as(emb))  # every token embeds to the same vector
        h = model.model(torch.tensor([[0]])).last_hidden_state[0, 0]
        unit = h / h.dot(h)  # a lm_head row r * unit gives logit r
        model.lm_head.weight.zero_()
        model.lm_head.weight[0:512:2] = 3.0 * unit
        model.lm_head.weight[512:] = 10.0 * unit
    model.save_pretrained(str(out), safe_serialization=True)
    return out


def test_opd_warmup_moves_the_student_toward_a_padded_vocab_teacher(tmp_path: Path):
    teacher = _make_teacher(tmp_path / "teacher")
    steps = 8
    run = _run(tmp_path, "experiment.steps=1", "experiment.warmup=opd", f"experiment.teacher_path={teacher}",
               f"experiment.warmup_steps={steps}", "experiment.warmup_batch_size=8", "algo.distill_coef=1.0",
               "trainer.lr=3e-3", "rollout.engines=1", "algo.drop_zero_signal=false",
               # Sampling at 0.7 (not the default's 1.0) keeps the student's own tokens where the teacher's
               # mass is, so eight steps move the reverse KL clearly. The system prompt too: on the bare
               # question (the default's prompt) eight steps lowered it by 15%, not the 20% asserted.
               "rollout.temperature=0.7", "data.prompt_template=default")
    records = [json.loads(line) for line in (run / "warmup.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, steps + 1)) and {r["mode"] for r in records} == {"opd"}
    kl = [r["reverse_kl"] for r in records]
    # A near-uniform student starts ~0.9 nats/token from the trimmed teacher (the padding rows would add ~12).
    assert 0.1 < kl[0] < 3.0, kl
    # The student samples its own tokens and moves toward the teacher's distribution over them.
    assert sum(kl[-3:]) / 3 < 0.8 * sum(kl[:3]) / 3, kl
    assert json.loads((run / "summary.json").read_text())["steps_done"] == 1
    # The RL step after the OPD warm-up trains without the distillation term (algo.rl_distill_coef unset).
    rl = _records(run)
    assert len(rl) == 1 and "loss/distill" not in rl[0] and "loss/policy" in rl[0]


# Colocated hand-off: the rollout waits with the trainer's parameters in host memory, and the relief's push
# must bring them back for itself.
@pytest.mark.parametrize("placement", ["disaggregated", "colocated"])
def test_only_engine_sigkilled_mid_rollout_is_pushed_the_current_weights_and_the_run_finishes(
        tmp_path: Path, placement: str):
    # One engine, synchronous GRPO: once it dies mid-rollout, its replacement comes up stale and only a push
    # of the current weights (made while the rollout waits) lets that rollout, and the run, go on. Without
    # it the rollout waits for the replacement until rollout.request_timeout_s and the run fails.
    steps, prompts, group = 3, 2, 4
    cmd = _train_cmd(tmp_path, f"cluster.placement={placement}", f"experiment.steps={steps}",
                     "experiment.warmup=none", "rollout.engines=1",
                     f"rollout.prompts_per_step={prompts}", f"rollout.group_size={group}",
                     "rollout.max_new_tokens=256", "rollout.async_steps=0", "algo.drop_zero_signal=false",
                     "fault_tolerance.health_interval_s=0.5", "fault_tolerance.failure_threshold=2",
                     "fault_tolerance.max_engine_restarts=1", "fault_tolerance.request_retries=4",
                     "rollout.request_timeout_s=30")
    log_path = tmp_path / "driver.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)
        run = tmp_path / "run"
        try:
            _wait(lambda: len(_records(run)) >= 1, 600, "the first RL step", proc)
            # Step 1's rollout starts as soon as step 0 is published: the kill lands in it.
            (engine,) = [pid for pid, c in _children(proc.pid) if "miles_lite.engines.reference.engine" in c]
            os.kill(engine, signal.SIGKILL)
            assert proc.wait(timeout=240) == 0, log_path.read_text()[-3000:]
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    console = log_path.read_text()
    records = _records(run)
    assert json.loads((run / "summary.json").read_text())["steps_done"] == steps
    assert [r["step"] for r in records] == list(range(1, steps + 1)), "every step ran, none twice"
    # The kill met step 1's requests in flight: they failed and were re-sent (partial work kept).
    assert records[1]["rollout/retried_requests"] >= 1 and records[1]["fleet/restarts"] == 1, records[1]
    version = records[0]["weight_version"]  # what the engines served during step 1's rollout
    assert "is dead" in console and "replacement up" in console
    relief = [line for line in console.splitlines() if "no healthy engine left mid-rollout" in line]
    assert len(relief) == 1 and f"pushed the current version {version} to reference-0.1 " in relief[0], console[-3000:]
    assert float(relief[0].rsplit("probe logp diff mean ", 1)[1]) < 1e-3, "probe-verified like every push"
    assert console.index("replacement up") < console.index(f"replacement admitted after push {version}") \
        < console.index(relief[0])
    assert all(r["fleet/engines_healthy"] == 1 and r["fleet/engines_dead"] == 0 for r in records[1:])
    if placement == "colocated":  # the roles really handed the device over every step
        assert all(r["time/onload_seconds"] >= 0 and "time/engine_wake_seconds" in r for r in records), records
    # No sample lost or trained twice: every step trained all its groups, each prompt once in the run.
    from miles_lite.observability.rollout_table import read_rollouts

    table = read_rollouts(run).to_pylist()
    for step in range(1, steps + 1):
        rows = [r for r in table if r["step"] == step]
        assert sorted((r["prompt_index"], r["sample_index"]) for r in rows) == sorted(
            (p, s) for p in {r["prompt_index"] for r in rows} for s in range(group)) and len(rows) == prompts * group
    assert len({r["prompt_index"] for r in table}) == steps * prompts
    # Step 1's completions, resumed on the replacement, carry the version of the weights they were pushed.
    assert {r["weight_version"] for r in table if r["step"] == 2} == {str(version)}
