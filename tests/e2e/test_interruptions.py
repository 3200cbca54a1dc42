"""Short runs of the embedded default, interrupted or diverging: a stop signal during the SFT warm-up ends
the run within a step; Ctrl-C prints the command that continues the run and that command (the same one, on a
time-stamped run) continues it, its evaluations before RL kept; a second Ctrl-C aborts at once with exit 130 and
one message, every file whole; a learning rate that explodes the weights is refused step by step, then ends the
run with the last good weights checkpointed and the reason said. Steps count from 1 in every output."""

from __future__ import annotations

import json
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from miles_lite.checkpoint import CheckpointReader
from miles_lite.observability.rollout_table import read_rollouts
from miles_lite.observability.sinks import read_metrics_file

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
README = Path(__file__).resolve().parents[2] / "README.md"

SHORT = ["experiment.run_name=run", "data.presample.enabled=false", "rollout.engines=1", "rollout.prompts_per_step=2",
         "rollout.group_size=2", "rollout.max_new_tokens=8", "data.synthetic.eval_size=1",
         "observability.progress=false"]


def _start(tmp_path: Path, *overrides: str, short: list[str] = SHORT, cwd: Path | None = None
           ) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-u", "-m", "miles_lite.cli", "train", f"experiment.output_dir={tmp_path}", *short,
           *overrides]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd)


def _assert_whole(run: Path, curves: bool = True) -> None:
    """No file of the run left empty or half-written (the lock file is empty once released; a log of records
    is empty until its first record)."""
    for path in run.rglob("*"):
        assert ".tmp-" not in path.name and not path.name.endswith(".tmp"), path
        if path.is_file() and path.name != ".lock" and path.suffix != ".jsonl":
            assert path.stat().st_size > 0, path
    if curves:
        assert (run / "curves.png").stat().st_size > 1000


def _readme_run_directory() -> tuple[set[str], set[str]]:
    """The entries of the README's run-directory table, and those it says every run writes."""
    table = README.read_text().split("**The run directory**", 1)[1].split("\n\n", 2)[1]
    listed, always = set(), set()
    for row in table.splitlines()[2:]:
        cells = [c.strip() for c in row.strip("|").split("|")]
        names = {n.strip("/") for n in re.findall(r"`([^`]+)`", cells[0])}
        listed |= names
        if cells[-1].startswith("always"):
            always |= names
    return listed, always


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
    assert proc.returncode == 130 and "aborting now" in out, out[-3000:]
    assert "sft warm-up stopped" not in out
    # One short message, no traceback: what happened, and how to go on.
    assert "Traceback" not in out, out[-3000:]
    after = out.split("second interrupt", 1)[1].strip().splitlines()
    assert len(after) <= 5, after
    assert f"miles-lite train: aborted by a second Ctrl-C in {tmp_path / 'run'}" in out
    assert "the same command again; it starts it again (warm-up included)" in out
    _assert_whole(tmp_path / "run", curves=False)


def test_ctrl_c_says_how_to_go_on_and_the_same_command_continues_the_run(tmp_path: Path) -> None:
    out_dir = tmp_path / "out"
    # No experiment.run_name: the run is time-stamped, as a user's first run is.
    overrides = [f"experiment.output_dir={out_dir}", *SHORT[1:], "experiment.warmup_steps=3", "experiment.steps=4",
                 "checkpoint.interval=1", "data.synthetic.eval_size=8"]
    proc = subprocess.Popen([sys.executable, "-u", "-m", "miles_lite.cli", "train", *overrides], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen: list[str] = []
    _wait_for(proc, "step 2/4", seen)
    proc.send_signal(signal.SIGINT)
    first = _finish(proc, seen, timeout=300)
    assert proc.returncode == 0, first[-3000:]
    hint = re.search(r"to go on, run in (.+) the same command again; it continues it from its newest checkpoint:\n"
                     r"  (.+)\n", first)
    assert hint is not None, first[-3000:]
    where, command = hint.group(1), hint.group(2)
    assert where == str(tmp_path)
    assert shlex.split(command) == [sys.executable, "-m", "miles_lite.cli", "train", *overrides]
    (run,) = [p for p in out_dir.iterdir() if not p.name.startswith(".")]
    assert run.name.startswith("tiny_cpu-") and f"experiment.run_name={run.name}" in first
    stopped = json.loads((run / "summary.json").read_text())
    done = stopped["steps_done"]
    assert stopped["stopped_by_signal"] and done in (2, 3), stopped  # the step in progress at the signal ends
    before = stopped["before"]
    assert before["n"] >= 1 and "exact" in before
    _assert_whole(run)

    # The printed command, run as printed where it says, continues that run from its checkpoint.
    again = subprocess.run(command, shell=True, cwd=where, capture_output=True, text=True, timeout=500)
    second = again.stdout + again.stderr
    assert again.returncode == 0, second[-3000:]
    assert f"continuing the unfinished run {run}" in second
    assert f"resumed from {run / 'checkpoints' / f'step_{done:08d}'} at step {done}" in second
    assert "sft warm-up" not in second
    assert [p.name for p in out_dir.iterdir() if not p.name.startswith(".")] == [run.name]
    assert not any((out_dir / ".unfinished").iterdir())  # finished: a new start of these settings is a new run
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps_done"] == 4 and not summary["stopped_by_signal"]
    # The evaluations before RL survive the resume, and so does the line comparing them with after RL.
    assert summary["before"] == before and summary["after"]["n"] == before["n"]
    assert re.search(r"exact accuracy on held-out problems: [\d.]+% after warm-up -> [\d.]+% after RL", second)

    # One step numbering: the console, metrics.jsonl, the rollout table, checkpoints and weight versions.
    assert [int(n) for n in re.findall(r"^step (\d+)/4 \|", first + second, re.M)] == [1, 2, 3, 4]
    records = read_metrics_file(run)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert [r["weight_version"] for r in records] == [1, 2, 3, 4]  # the push after step k carries k
    assert sorted(p.name for p in (run / "rollouts").iterdir()) == [f"step_{k:06d}.parquet" for k in (1, 2, 3, 4)]
    table = read_rollouts(run).to_pylist()
    assert {(r["step"], r["weight_version"]) for r in table} == {(k, str(k - 1)) for k in (1, 2, 3, 4)}
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == ["step_00000003", "step_00000004"]
    _assert_whole(run)

    # The README's run-directory table describes what this run wrote.
    listed, always = _readme_run_directory()
    written = {p.name for p in run.iterdir() if not p.name.startswith(".")}
    assert written <= listed, written - listed
    assert always <= written, always - written

    # Rolling back to a step retention removed names the steps kept.
    pruned = run / "checkpoints" / "step_00000001"
    back = subprocess.run([sys.executable, "-m", "miles_lite.cli", "train", *overrides,
                           f"experiment.run_name={run.name}", f"checkpoint.resume={pruned}"],
                          capture_output=True, text=True, timeout=300)
    assert back.returncode == 2, back.stderr[-2000:]
    assert "no longer holds step 1: it keeps step_00000003, step_00000004" in back.stderr

    # `miles-lite eval` takes the run: its newest checkpoint, evaluated on the run's own held-out problems.
    evaluation = subprocess.run([sys.executable, "-m", "miles_lite.cli", "eval", str(run), "--log-dir",
                                 str(tmp_path / "eval_logs")], capture_output=True, text=True, timeout=400)
    assert evaluation.returncode == 0, evaluation.stdout[-2000:] + evaluation.stderr[-2000:]
    assert f"{run} (checkpoint step 4), with the run's configuration" in evaluation.stdout
    assert f"{run} on its held-out problems ({int(summary['after']['n'])} problems, greedy)" in evaluation.stdout
    exact = re.search(r"right answer and exact format\s+([\d.]+)%", evaluation.stdout)
    assert exact is not None and float(exact.group(1)) == pytest.approx(summary["after"]["exact"] * 100, abs=0.051)
    # A checkpoint's hf/ folder holds no weights: refused, naming the checkpoint to pass.
    hf_dir = run / "checkpoints" / "step_00000004" / "hf"
    hf = subprocess.run([sys.executable, "-m", "miles_lite.cli", "eval", str(hf_dir), "synthetic"],
                        capture_output=True, text=True, timeout=300)
    assert hf.returncode == 2 and "no weights; pass the checkpoint itself" in hf.stderr, hf.stderr[-2000:]


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
