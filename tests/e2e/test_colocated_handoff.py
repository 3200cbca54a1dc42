"""`cluster.placement=colocated` through `miles-lite train` on CPU: the engines sleep while the trainer trains,
the trainer's state leaves the device while they generate, and the run learns what a resident run learns."""

from __future__ import annotations

import itertools
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

SHORT = ["experiment.run_name=colo", "experiment.warmup_steps=4", "data.presample.enabled=false",
         "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=16",
         "data.synthetic.eval_size=4", "observability.progress=false", "experiment.steps=2",
         "cluster.placement=colocated"]


def _train(out: Path, *extra: str) -> list[dict]:
    cmd = [sys.executable, "-m", "miles_lite.cli", "train", f"experiment.output_dir={out}", *SHORT, *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads(x) for x in (out / "colo" / "metrics.jsonl").read_text().splitlines()]


def test_colocated_handoff_loop_and_its_transitions(tmp_path: Path) -> None:
    # A checkpoint every step: saved between the push's preparation and the push, from the staged host copies.
    handoff = _train(tmp_path / "handoff", "checkpoint.interval=1")
    resident = _train(tmp_path / "resident", "cluster.colocated_memory=resident")
    assert [r["step"] for r in handoff] == [1, 2]
    for row in handoff:
        for transition in ("offload", "onload", "engine_sleep", "engine_wake"):
            assert row[f"time/{transition}_seconds"] > 0.0, transition
        # On CPU there is always room: the optimizer state left while the push ran, settled before the KV wake.
        assert row["time/offload_overlapped"] == 1.0
        # The trainer's state is off the device while the engines generate and after the push, on it to train.
        assert row["memory/generate_trainer_state_bytes"] == 0.0 == row["memory/sync_trainer_state_bytes"]
        assert row["memory/train_trainer_state_bytes"] > 0.0
        assert row["sync/probe_logp_diff_max"] < 1e-5  # every push verified against the trainer
        assert row["fleet/engines_healthy"] == 2.0 and row["fleet/engines_sleeping"] == 0.0
        # The push's phases, in order and without gaps: together nearly its wall time (`sync/seconds`; they
        # leave out the offload's calls, the transport's reconnect and the fleet's bookkeeping after the push).
        # The trainer's probe scores come first, before the offload's copies are queued.
        phases = [k for k in row if k.startswith("sync/phase_")]
        assert phases == [f"sync/phase_{p}_seconds" for p in ("probe_trainer", "wake_weights", "begin",
                                                               "probe_before", "pause", "load", "check",
                                                               "after_load", "resume", "verify")]
        assert all(row[k] >= 0.0 for k in phases)
        assert 0.8 * row["sync/seconds"] <= sum(row[k] for k in phases) <= row["sync/seconds"]
        assert row["sync/phase_load_seconds"] > 0.0 and row["sync/phase_verify_seconds"] > 0.0
    # The hand-off's checkpoints were written from the host copies staged for its push: the last one holds the
    # state the resident run's final checkpoint (an ordinary snapshot) holds, weights and Adam moments alike.
    from miles_lite.checkpoint import CheckpointReader, newest_complete

    readers = [CheckpointReader(newest_complete(tmp_path / layout / "colo" / "checkpoints"))
               for layout in ("handoff", "resident")]
    assert [r.step for r in readers] == [2, 2]
    names = readers[0].global_names()
    assert names == readers[1].global_names() and any(n.startswith("optim/exp_avg/") for n in names)
    for name in names:
        assert torch.allclose(readers[0].global_tensor(name), readers[1].global_tensor(name),
                              rtol=1e-4, atol=1e-6), name
    # One meaning of a weight version in both layouts: step k's completions came from the weights of k - 1 RL steps.
    from miles_lite.observability.rollout_table import read_rollouts

    for layout in ("handoff", "resident"):
        table = read_rollouts(tmp_path / layout / "colo").to_pylist()
        assert {(r["step"], r["weight_version"]) for r in table} == {(1, "0"), (2, "1")}, layout
    assert [r["weight_version"] for r in handoff] == [1, 2]  # the push after step k carries k
    for row in resident:
        assert "time/offload_seconds" not in row and "time/engine_wake_seconds" not in row
        assert "time/offload_overlapped" not in row
        assert row["memory/generate_trainer_state_bytes"] == row["memory/train_trainer_state_bytes"] > 0.0
    # Same seeds, same tokens: the hand-over changes nothing the run computes (logprobs agree to float rounding:
    # the engines' continuous batching differs in timing between runs).
    assert [r["reward/mean"] for r in handoff] == [r["reward/mean"] for r in resident]
    for key in ("loss/total", "grad_norm", "entropy"):
        assert [r[key] for r in handoff] == pytest.approx([r[key] for r in resident], rel=1e-5, abs=1e-7), key

    # The run's log times the start-up's stages: the trainer's state offloaded before the engines started.
    startup = [line for line in (tmp_path / "handoff" / "colo" / "logs" / "run.log").read_text().splitlines()
               if "start-up:" in line]
    assert len(startup) == 1
    assert re.search(r"INFO miles_lite.run.system: start-up: model [\d.]+ s, trainer [\d.]+ s, trainer offload "
                     r"[\d.]+ s, engines [\d.]+ s, weight sync [\d.]+ s$", startup[0]), startup

    # Every engine: each push woke its weights, loaded (in one or more buckets), then resumed its KV cache; it
    # slept before each training phase (warm-up, two steps, the final checkpoint) and woke for each push (first,
    # two steps, the final evaluation).
    for log in sorted((tmp_path / "handoff" / "colo" / "logs").glob("reference-*.log")):
        events = [m.group(1) for line in log.read_text().splitlines()
                  if (m := re.search(r"(released memory|resumed memory \['weights'\]|resumed memory \['kv_cache'"
                                     r"|Weight version updated to)", line))]
        events = [event for event, _ in itertools.groupby(events)]  # a version may land in several buckets
        assert events == ["released memory", "resumed memory ['weights']", "Weight version updated to",
                          "resumed memory ['kv_cache'"] * 4, (log.name, events)


def test_offload_when_needed_runs_through_the_real_roles(tmp_path: Path) -> None:
    """`trainer.offload.when=needed` through `miles-lite train`: the trainer's ranks answer the hand-off's memory
    questions; a CPU has no device memory to share, so every part moves as with `always` (what stays on a GPU is
    measured by `scripts/gpu_checks.sh colocated-0.5b-kept`)."""
    rows = _train(tmp_path / "needed", "trainer.offload.when=needed", "checkpoint.interval=1")
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["time/offload_seconds"] > 0.0 and row["sync/probe_logp_diff_max"] < 1e-5
        assert row["memory/generate_trainer_state_bytes"] == 0.0 < row["memory/train_trainer_state_bytes"]
    from miles_lite.checkpoint import newest_complete

    assert newest_complete(tmp_path / "needed" / "colo" / "checkpoints") is not None
