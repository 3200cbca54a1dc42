"""Optional sinks against their real packages (each test skips where its package is not installed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from miles_lite.observability import TensorBoardSink


def test_tensorboard_sink_writes_readable_scalars(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sink = TensorBoardSink(tmp_path)
    sink.log(1, {"reward/mean": 1.5, "note": "text is skipped", "loss/total": float("nan")})
    sink.log(2, {"reward/mean": 2.5, "rollout/request_latency_seconds": [0.1, 0.2]})
    sink.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("reward/mean")] == [(1, 1.5), (2, 2.5)]
    assert set(events.Tags()["scalars"]) == {"reward/mean"}
