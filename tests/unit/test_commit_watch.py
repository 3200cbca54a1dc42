"""`miles_lite_checkpoint_step` follows commits, background saves included: the watcher sees a save's commit on
the flush thread without anyone waiting for the save, and reports each committed step once."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import torch
from prometheus_client.parser import text_string_to_metric_families

from miles_lite.checkpoint import AsyncCheckpointer, CheckpointPayload, GlobalPiece
from miles_lite.checkpoint.commit_watch import CommitWatcher, committed_step
from miles_lite.observability.metrics import MetricsRegistry


def _gauge(metrics: MetricsRegistry, name: str) -> float | None:
    for family in text_string_to_metric_families(metrics.exposition().decode()):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    return None


def test_a_background_commit_sets_the_gauge_before_anyone_waits_for_the_save(tmp_path: Path):
    metrics = MetricsRegistry("run", "driver")
    seen: list[int] = []
    committed = threading.Event()

    def on_commit(step: int) -> None:
        seen.append(step)
        metrics.checkpoint_step(step)
        committed.set()

    watcher = CommitWatcher(tmp_path, on_commit, interval_s=0.02).start()
    try:
        assert seen == [] and _gauge(metrics, "miles_lite_checkpoint_step") is None  # nothing committed yet
        saver = AsyncCheckpointer(tmp_path, async_save=True)
        stats = saver.save(4, CheckpointPayload(pieces=[GlobalPiece.whole("w", torch.zeros(64, 64))]))
        assert not stats.complete  # training goes on: nobody waits for this save
        assert committed.wait(30.0), "the commit was not seen"
        assert seen == [4] and _gauge(metrics, "miles_lite_checkpoint_step") == 4.0
        assert committed_step(tmp_path) == 4
        saver.save(6, CheckpointPayload(pieces=[GlobalPiece.whole("w", torch.ones(64, 64))]))
        deadline = time.monotonic() + 30.0
        while seen[-1] != 6:
            assert time.monotonic() < deadline, seen
            time.sleep(0.02)
        saver.close()
    finally:
        watcher.stop()
    assert seen == [4, 6] and _gauge(metrics, "miles_lite_checkpoint_step") == 6.0


def test_a_pointer_to_a_missing_directory_is_no_commit(tmp_path: Path):
    (tmp_path / "latest").write_text("step_00000003")
    assert committed_step(tmp_path) is None
    (tmp_path / "step_00000003").mkdir()
    assert committed_step(tmp_path) == 3
