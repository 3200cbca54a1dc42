"""The exporter against a real Prometheus: scrape every second, then run every dashboard query.

A short synthetic run (real rewards, advantages, mismatch metrics and loss; see
services/synthetic_run.py) feeds a `MetricsRegistry`; after each step the test waits until
Prometheus has scraped that step, so rates and histograms have several samples.
"""

from __future__ import annotations

import json
import math
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from services.prometheus import PrometheusServer, PrometheusUnavailable, ensure_prometheus_installed
from services.synthetic_run import synthetic_steps

from miles_lite.observability import ENGINE_STATES, MetricsExporter, MetricsRegistry, nvml_collector

pytestmark = pytest.mark.integration

DASHBOARD = Path(__file__).resolve().parents[2] / "k8s" / "grafana" / "miles-lite.json"
STEPS = 4
GPU_METRIC_PREFIX = "miles_lite_gpu_"


@dataclass
class ScrapedRun:
    server: PrometheusServer
    run: str
    last_stats: dict[str, object]
    gpu: bool
    config_check: str


def _dashboard_exprs() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target of every panel."""
    dash = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in dash["panels"] if p.get("type") != "row" for t in p.get("targets", [])]


def _step_scraped(server: PrometheusServer, run: str, step: int) -> bool:
    result = server.query(f'miles_lite_step{{run="{run}"}}')
    return bool(result) and float(result[0]["value"][1]) >= step


@pytest.fixture(scope="module")
def scraped_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ScrapedRun]:
    try:
        binary, promtool = ensure_prometheus_installed()
    except PrometheusUnavailable as err:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the Prometheus test: {err}")
        pytest.skip(str(err))
    run = f"itest-{uuid.uuid4().hex[:8]}"
    registry = MetricsRegistry(run, "driver")
    gpu = nvml_collector(run, "driver")
    if gpu is not None:
        registry.register_collector(gpu)
    workdir = tmp_path_factory.mktemp("prometheus")
    with MetricsExporter(registry, "127.0.0.1", 0) as exporter:
        server = PrometheusServer(workdir, [f"127.0.0.1:{exporter.port}"], binary, promtool)
        config_check = server.check_config()
        server.start()
        try:
            registry.set_engine_states({"starting": 2})
            last: dict[str, object] = {}
            for item in synthetic_steps(STEPS, workdir=workdir):
                registry.publish_step(item.step, item.stats)
                registry.sync_done("distributed", float(item.stats["time/sync_seconds"]), item.sync_bytes,
                                   item.step, probe_logp_diff=1e-5 * item.step)
                registry.checkpoint_blocked(float(item.stats["time/checkpoint_seconds"]))
                registry.checkpoint_committed(0.01 * item.step, item.checkpoint_bytes, item.step)
                if item.step == 2:
                    # One engine dies and is replaced: the fleet events the dashboard shows.
                    registry.set_engine_states({"healthy": 1, "dead": 1})
                    registry.engine_restarted()
                    registry.set_engine_states({"healthy": 1, "stale": 1})
                else:
                    registry.set_engine_states({"healthy": 2})
                last = item.stats
                # The first scrape lands ~6 s after start (discovery throttle); later ones every second.
                server.wait_for(lambda s=item.step: _step_scraped(server, run, s), 45.0, f"step {item.step} scraped")
            # One more scrape after the last step so every rate() has a sample past the final increments.
            before = server.query(f'timestamp(miles_lite_step{{run="{run}"}})')[0]["value"][1]
            server.wait_for(lambda: server.query(f'timestamp(miles_lite_step{{run="{run}"}})')[0]["value"][1] != before,
                            15.0, "one more scrape")
            yield ScrapedRun(server, run, last, gpu is not None, config_check)
        finally:
            server.stop()


def test_promtool_accepts_generated_config(scraped_run: ScrapedRun) -> None:
    assert "SUCCESS" in scraped_run.config_check


def test_exporter_target_is_up(scraped_run: ScrapedRun) -> None:
    assert scraped_run.server.targets_health() == ["up"]
    up = scraped_run.server.query('up{job="miles-lite"}')
    assert [float(r["value"][1]) for r in up] == [1.0]


def test_every_dashboard_query_returns_data(scraped_run: ScrapedRun) -> None:
    exprs = _dashboard_exprs()
    assert len(exprs) >= 30
    empty, non_finite = [], []
    checked = 0
    for title, expr in exprs:
        if GPU_METRIC_PREFIX in expr and not scraped_run.gpu:
            continue  # NVML absent: GPU series are not exported at all (never faked).
        promql = expr.replace("$run", scraped_run.run).replace("$__rate_interval", "1m")
        result = scraped_run.server.query(promql)
        checked += 1
        if not result:
            empty.append((title, promql))
        elif not any(math.isfinite(float(r["value"][1])) for r in result):
            non_finite.append((title, promql, result))
    assert checked >= 28
    assert not empty, f"panels without data: {empty}"
    assert not non_finite, f"panels with only NaN/inf: {non_finite}"


def test_scraped_values_match_the_last_step(scraped_run: ScrapedRun) -> None:
    server, run, stats = scraped_run.server, scraped_run.run, scraped_run.last_stats

    def value(expr: str) -> float:
        result = server.query(expr)
        assert len(result) == 1, (expr, result)
        return float(result[0]["value"][1])

    sel = f'run="{run}",role="driver"'
    assert value(f"miles_lite_step{{{sel}}}") == STEPS
    assert value(f"miles_lite_reward_mean{{{sel}}}") == pytest.approx(stats["reward/mean"])
    assert value(f"miles_lite_exact_accuracy_ratio{{{sel}}}") == pytest.approx(stats["reward/exact_accuracy"])
    assert value(f'miles_lite_is_ratio_mean{{{sel},kind="raw"}}') == pytest.approx(stats["mismatch/is_raw_mean"])
    assert value(f'miles_lite_is_ratio_mean{{{sel},kind="applied"}}') == pytest.approx(
        stats["mismatch/is_applied_mean"])
    assert value(f"miles_lite_logp_diff_max_nats{{{sel}}}") == pytest.approx(stats["mismatch/logp_abs_diff_max"])
    assert value(f"miles_lite_engine_restarts_total{{{sel}}}") == 1
    assert value(f"miles_lite_rollout_retried_requests_total{{{sel}}}") == 1
    assert value(f"miles_lite_checkpoints_total{{{sel}}}") == STEPS
    assert value(f'miles_lite_reward_value_count{{{sel},reward="total"}}') == STEPS * 16
    states = {r["metric"]["state"]: float(r["value"][1]) for r in server.query(f"miles_lite_engines{{{sel}}}")}
    assert states == {s: (2.0 if s == "healthy" else 0.0) for s in ENGINE_STATES}


def test_run_variable_lists_the_run(scraped_run: ScrapedRun) -> None:
    dash = json.loads(DASHBOARD.read_text())
    variable = next(v for v in dash["templating"]["list"] if v["name"] == "run")
    assert variable["query"]["query"] == "label_values(miles_lite_step, run)"
    assert scraped_run.run in scraped_run.server.label_values("run", "miles_lite_step")
