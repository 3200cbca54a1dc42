"""Metrics file sink, optional sinks, and the HTML report rendered from a synthetic run directory.

The run directory is produced by the same synthetic run as the Prometheus test (real rewards,
advantages, mismatch metrics and loss), written through the real MetricsFileSink and rollout table.
"""

from __future__ import annotations

import base64
import importlib.util
import json
import math
import re
import sys
from pathlib import Path

import pytest

from miles_lite.cli import main as cli_main
from miles_lite.config.schema import ObservabilityConfig
from miles_lite.observability import MetricsFileSink, RolloutTableWriter, build_sinks, read_metrics_file
from miles_lite.observability.report import best_and_worst, render_report
from miles_lite.observability.rollout_table import read_rollouts

_FEED = Path(__file__).resolve().parents[1] / "integration" / "services" / "synthetic_run.py"
STEPS = 8


def _load_feed():  # noqa: ANN202 - module object
    spec = importlib.util.spec_from_file_location("synthetic_run_for_report", _FEED)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("runs") / "synthetic-run"
    sink = MetricsFileSink(root)
    table = RolloutTableWriter(root)
    for item in _load_feed().synthetic_steps(STEPS, prompts=4, group_size=4, seed=1):
        sink.log(item.step, item.stats)
        table.write_groups(item.step, item.groups)
    sink.close()
    return root


def test_metrics_file_is_one_json_object_per_step(run_dir: Path) -> None:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == STEPS
    first = json.loads(lines[0])
    assert first["step"] == 1 and isinstance(first["time"], float)
    assert "reward/mean" in first and "mismatch/is_raw_mean" in first
    assert not any(k.startswith("reward/values/") for k in first)  # lists go to histograms, not here
    records = read_metrics_file(run_dir)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))


def test_metrics_file_nonfinite_and_relogged_steps(tmp_path: Path) -> None:
    sink = MetricsFileSink(tmp_path)
    sink.log(1, {"loss/total": float("nan"), "reward/mean": 1.0, "flag": True})
    sink.log(1, {"reward/mean": 2.0})  # a resumed run logs the step again: the last one wins
    sink.close()
    assert "NaN" not in (tmp_path / "metrics.jsonl").read_text()
    (record,) = read_metrics_file(tmp_path)
    assert record["reward/mean"] == 2.0
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write("[1, 2]\n")
    with pytest.raises(ValueError, match="metrics.jsonl:3"):
        read_metrics_file(tmp_path)
    with pytest.raises(FileNotFoundError, match="run directory"):
        read_metrics_file(tmp_path / "nope")


def test_optional_sinks_fail_clearly_when_missing(tmp_path: Path) -> None:
    sinks = build_sinks(ObservabilityConfig(), tmp_path, "r")
    assert [type(s).__name__ for s in sinks] == ["MetricsFileSink"]
    for s in sinks:
        s.close()
    for flag, package in (("tensorboard", "tensorboard"), ("wandb", "wandb")):
        if importlib.util.find_spec(package) is not None:
            continue  # installed: the sink is constructible; nothing to assert about the error
        with pytest.raises(ImportError, match=f"observability.{flag}=true needs the '{package}' package"):
            build_sinks(ObservabilityConfig(**{flag: True}), tmp_path / flag, "r")


@pytest.fixture(scope="module")
def report_page(run_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> str:
    """`miles-lite report RUN_DIR --out ... --top 3`, with its PNGs also saved beside it for a person to look at."""
    out_dir = tmp_path_factory.mktemp("report")
    out = out_dir / "report.html"
    assert cli_main(["report", str(run_dir), "--out", str(out), "--top", "3"]) == 0
    page = out.read_text()
    for i, data in enumerate(re.findall(r'src="data:image/png;base64,([^"]+)"', page)):
        (out_dir / f"plot_{i}.png").write_bytes(base64.b64decode(data))
    return page


def test_report_is_self_contained_html(report_page: str) -> None:
    page = report_page
    assert page.startswith("<!doctype html>") and page.rstrip().endswith("</html>")
    assert "synthetic-run" in page and f"{STEPS} steps" in page
    images = re.findall(r'src="data:image/png;base64,([^"]+)"', page)
    assert len(images) == 5  # reward, mismatch, zero-signal, step time, reward functions
    for data in images:
        assert base64.b64decode(data).startswith(b"\x89PNG\r\n\x1a\n")
    assert "http://" not in page and "https://" not in page  # nothing to fetch
    assert "Best 3 completions" in page and "Worst 3 completions" in page
    assert "<SOLUTION>" not in page and "&lt;SOLUTION&gt;" in page  # completions are escaped


def test_best_and_worst_pick_the_extremes(run_dir: Path) -> None:
    table = read_rollouts(run_dir)
    best, worst = best_and_worst(table, 2)
    totals = [t for t in table["total"].to_pylist() if not math.isnan(t)]
    assert [table["total"][i].as_py() for i in best] == sorted(totals, reverse=True)[:2]
    assert [table["total"][i].as_py() for i in worst] == sorted(totals)[:2]


def test_report_of_a_sparse_run_says_what_is_missing(tmp_path: Path) -> None:
    sink = MetricsFileSink(tmp_path)
    sink.log(0, {"reward/mean": 1.0})
    sink.close()
    page = render_report(tmp_path)
    assert page.count("data:image/png;base64,") == 1
    assert "mismatch: not recorded" in page and "No rollout table" in page


def test_cli_errors(tmp_path: Path) -> None:
    assert cli_main(["report", str(tmp_path / "not-a-run")]) == 2
    (tmp_path / "metrics.jsonl").write_text("")
    assert cli_main(["report", str(tmp_path)]) == 2
    assert cli_main(["report", str(tmp_path), "--top", "-1"]) == 2
