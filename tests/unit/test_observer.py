"""RunObserver: one publish per step reaches Prometheus, metrics.jsonl, the rollout table and the console."""

from __future__ import annotations

import io
import urllib.request
from pathlib import Path

import pytest
from rich.console import Console

from miles_lite.config.schema import ObservabilityConfig
from miles_lite.observability import ObserverState, RunObserver, read_metrics_file, read_rollouts
from miles_lite.types import Group, Sample


def scored_group(index: int) -> Group:
    g = Group(prompt_index=index, prompt_text=f"Q{index}", question="q", answer=1.0, steps=())
    for total in (0.0, 5.25):
        g.samples.append(Sample(prompt_index=index, prompt_ids=[1], response_ids=[2, 3], rollout_logprobs=[-0.1, -0.3],
                                response_text="a", finish_reason="stop", rewards={"exact_check": total / 5.25,
                                                                                  "total": total}))
    return g


def test_publish_fans_out_and_close_stops_everything(tmp_path: Path) -> None:
    out = io.StringIO()
    observer = RunObserver(ObservabilityConfig(metrics_port=0), tmp_path / "run", "obs-run", total_steps=2,
                           console=Console(file=out, force_terminal=False, width=200))
    with observer:
        assert observer.state is ObserverState.OPEN and observer.exporter is not None
        url = observer.exporter.url
        line = observer.publish(1, {"reward/mean": 2.625, "reward/exact_accuracy": 0.5}, [scored_group(0)])
        observer.publish(2, {"reward/mean": 3.0}, [scored_group(0), scored_group(1)])
        with urllib.request.urlopen(url, timeout=5) as resp:
            body = resp.read().decode()
        assert 'miles_lite_reward_mean{role="driver",run="obs-run"} 3.0' in body
    assert observer.state is ObserverState.CLOSED
    assert line.startswith("step 1/2 | reward 2.625 | exact 0.50") and line in out.getvalue()
    assert [r["reward/mean"] for r in read_metrics_file(tmp_path / "run")] == [2.625, 3.0]
    assert read_rollouts(tmp_path / "run")["step"].to_pylist() == [1, 1, 2, 2, 2, 2]
    with pytest.raises(OSError):
        urllib.request.urlopen(url, timeout=2)
    with pytest.raises(RuntimeError, match="closed"):
        observer.publish(3, {})


def test_disabled_outputs_stay_off(tmp_path: Path) -> None:
    cfg = ObservabilityConfig(metrics_enabled=False, rollout_table=False, progress=False)
    with RunObserver(cfg, tmp_path, "quiet", total_steps=1,
                     console=Console(file=io.StringIO(), force_terminal=False)) as observer:
        assert observer.exporter is None and observer.table is None
        observer.publish(1, {"reward/mean": 1.0}, [scored_group(0)])
    assert not (tmp_path / "rollouts").exists()
    assert len(read_metrics_file(tmp_path)) == 1
