"""RunObserver: one publish per step reaches Prometheus, metrics.jsonl, the rollout table and the console."""

from __future__ import annotations

import io
import threading
import time
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


def test_linger_waits_for_a_final_scrape_only_after_a_clean_run(tmp_path: Path) -> None:
    cfg = ObservabilityConfig(metrics_port=0, progress=False, rollout_table=False, linger_s=60.0)
    console = Console(file=io.StringIO(), force_terminal=False)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="boom"), RunObserver(cfg, tmp_path / "a", "failed", 1, console=console):
        raise RuntimeError("boom")
    assert time.monotonic() - start < 30  # a failed run stops its exporter at once, no 60 s linger

    observer = RunObserver(cfg, tmp_path / "b", "clean", 1, console=console).open()
    assert observer.exporter is not None
    observer.publish(1, {"reward/mean": 1.25})
    bodies: list[str] = []
    url = observer.exporter.url
    closer = threading.Thread(target=observer.close, kwargs={"linger": True})
    closer.start()
    while closer.is_alive():  # scrape like Prometheus until the lingering close returns
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                bodies.append(resp.read().decode())
        except OSError:
            break  # the exporter stopped between the check and the scrape
        closer.join(0.05)
    closer.join(10)
    assert not closer.is_alive() and observer.state is ObserverState.CLOSED
    assert any('miles_lite_reward_mean{role="driver",run="clean"} 1.25' in b for b in bodies)
