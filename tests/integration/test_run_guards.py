"""Start-up guards of `miles-lite train`, each in real processes: a finished run re-run is a no-op, a run
directory held by a live run is refused naming the holder, and a stale Ray cluster recorded on the
machine does not capture a local run's Ray."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from miles_lite.checkpoint import AsyncCheckpointer, CheckpointPayload, GlobalPiece

pytestmark = pytest.mark.timeout(300)


def _train(tmp_path: Path, *overrides: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "miles_lite.cli", "train", f"experiment.output_dir={tmp_path}",
           "experiment.run_name=run", "observability.progress=false", *overrides]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def _tree(root: Path) -> dict[str, float]:
    # The run lock's file aside (any start takes the lock).
    return {str(p.relative_to(root)): p.stat().st_mtime for p in sorted(root.rglob("*")) if p.name != ".lock"}


def test_rerun_of_a_finished_run_is_a_noop(tmp_path: Path) -> None:
    run = tmp_path / "run"
    saver = AsyncCheckpointer(run / "checkpoints")
    saver.save(3, CheckpointPayload(pieces=[GlobalPiece.whole("w", torch.ones(4))], shared={}))
    saver.close()
    (run / "summary.json").write_text(json.dumps({"run_dir": str(run), "steps_done": 3, "wall_seconds": 1.0,
                                                  "before": {}, "after": {}, "stopped_by_signal": False}))
    before = _tree(run)
    start = time.monotonic()
    proc = _train(tmp_path, "experiment.steps=3")  # e.g. a Slurm requeue after the run completed
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "already finished 3 steps" in proc.stdout and "nothing to do" in proc.stdout
    assert _tree(run) == before  # nothing written, no engine started, no checkpoint touched
    assert time.monotonic() - start < 100


def test_second_writer_of_a_run_directory_is_refused(tmp_path: Path) -> None:
    run = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from miles_lite.run.lock import RunLock; RunLock(sys.argv[1]); "
                               "print('held', flush=True); sys.stdin.read()", str(run)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        proc = _train(tmp_path, "experiment.steps=1")
        assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
        err = proc.stderr.strip().splitlines()
        assert len(err) == 1 and f"pid {holder.pid}" in err[0] and "in use by host" in err[0], proc.stderr
        assert "Traceback" not in proc.stderr
        assert sorted(p.name for p in run.iterdir()) == [".lock"]  # the second run wrote nothing
    finally:
        holder.kill()
        holder.wait()
    # The kernel released the lock with its holder: the directory is free again.
    from miles_lite.run.lock import RunLock

    RunLock(run).release()


def test_data_error_is_one_line_with_exit_2_and_no_run_directory(tmp_path: Path) -> None:
    data = tmp_path / "train.jsonl"
    data.write_text('{"question": "1+1?", "answer": "2 #### 2"}\n{"question": "2+2?", "answer": "four"}\n')
    proc = _train(tmp_path / "out", "data.source=gsm8k", f"data.train_path={data}", "experiment.steps=1")
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("miles-lite train: data error: ") and str(data) in err[0], proc.stderr
    assert "####" in err[0]  # what the record lacks
    assert not (tmp_path / "out" / "run").exists()


@contextmanager
def _mounted(target: Path, *options: str) -> Iterator[Path]:
    """`mount ... target` for the test's duration (the CI runs as root; chmod does not stop root)."""
    target.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or subprocess.run(["mount", *options, str(target)], capture_output=True).returncode:
        pytest.skip("needs root and mount")
    try:
        yield target
    finally:
        subprocess.run(["umount", str(target)], check=True)


@contextmanager
def _read_only(target: Path) -> Iterator[Path]:
    source = target.with_name(target.name + "-src")
    source.mkdir()
    with _mounted(target, "--bind", str(source)):
        subprocess.run(["mount", "-o", "remount,bind,ro", str(target)], check=True)
        yield target


@pytest.mark.parametrize("kind", ["read-only", "full"])
def test_unusable_checkpoint_dir_is_refused_before_any_work(tmp_path: Path, kind: str) -> None:
    ckpt = tmp_path / "ckpt"
    mount = _read_only(ckpt) if kind == "read-only" else _mounted(
        ckpt, "-t", "tmpfs", "-o", "size=1m", "tmpfs")  # far less than a checkpoint of the tiny model
    with mount:
        proc = _train(tmp_path / "out", f"checkpoint.dir={ckpt}", "experiment.steps=1")
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and f"checkpoint.dir='{ckpt}'" in err[0], proc.stderr
    assert ("not writable (Read-only file system)" if kind == "read-only" else "MiB free") in err[0]
    assert "sft warm-up" not in proc.stdout + proc.stderr  # refused before any work
    assert not (tmp_path / "out" / "run").exists()  # and leaves no empty run directory


def test_local_ray_ignores_a_stale_recorded_cluster() -> None:
    # A short directory: Ray's unix sockets live under it (path length limit).
    with tempfile.TemporaryDirectory(prefix="rt", dir="/tmp") as tmp:
        (Path(tmp) / "ray").mkdir()
        # What an earlier `ray start` leaves behind: the address of a cluster that is gone.
        (Path(tmp) / "ray" / "ray_current_cluster").write_text("127.0.0.1:9\n")
        code = ("import ray; from miles_lite.config.schema import ClusterConfig; "
                "from miles_lite.cluster.ray_trainer import _init_ray; "
                "assert _init_ray(ClusterConfig(), 1); print('cpus', ray.cluster_resources().get('CPU')); "
                "ray.shutdown()")
        env = {**os.environ, "RAY_TMPDIR": tmp}
        env.pop("RAY_ADDRESS", None)
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "cpus 1.0" in proc.stdout
