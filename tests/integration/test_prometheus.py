"""The dashboard against a real Prometheus scraping the exporter of a short real training run.

`miles-lite train` runs the embedded default, shortened: the tiny Qwen2 model, two reference engines,
a few SFT warm-up steps, then STEPS GRPO steps, each followed by a verified weight push, with async
checkpoints. Prometheus scrapes the driver's exporter every second while the run is alive, and
`observability.linger_s` keeps the exporter up after the last step until a scrape has read the final
values (last step, final checkpoint commit). Once the exporter is gone Prometheus marks its series
stale, so every panel's query is evaluated at the time of that final scrape, as a dashboard looking
back at the run does.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from services.prometheus import PrometheusServer, PrometheusUnavailable, ensure_prometheus_installed, free_port

from miles_lite.net.ports import LOCAL_HOST
from miles_lite.observability import ENGINE_STATES, nvml_collector, read_metrics_file, read_rollouts

pytestmark = pytest.mark.integration

DASHBOARD = Path(__file__).resolve().parents[2] / "k8s" / "grafana" / "miles-lite.json"
GPU_METRIC_PREFIX = "miles_lite_gpu_"
# Router statistics exist for mixture-of-experts models only (this run trains the dense tiny Qwen2; the MoE
# run's scrape is tests/integration/test_moe_train_cli.py).
MOE_METRIC_PREFIX = "miles_lite_moe_"
# Agent-session counters come from agent runs' steps only (the keys' mapping: tests/unit/test_metrics.py).
AGENT_METRICS = ("miles_lite_agents_dropped_total", "miles_lite_session_")
STEPS = 4
PROMPTS, GROUP = 4, 4
RUN_TIMEOUT_S = 600.0
# Several scrapes must fall inside the run: on an idle machine its exporter was up for under 2 s (warm-up,
# STEPS steps and evaluations), within which 1 s scrapes saw it once before the final one.
SCRAPE_INTERVAL = "250ms"
# The embedded default, shortened. A KL coefficient keeps a reference model, so the trainer reports the
# KL the "KL and entropy" panel plots; a checkpoint every 2 steps makes step STEPS's async checkpoint
# the one the run's end waits for (blocked and flush seconds both measured).
SHORT = [f"experiment.steps={STEPS}", "experiment.warmup_steps=4", "data.presample.enabled=false",
         f"rollout.prompts_per_step={PROMPTS}", f"rollout.group_size={GROUP}", "data.synthetic.eval_size=4",
         "algo.kl_coef=0.001", "checkpoint.interval=2", "observability.progress=false",
         # A held-out evaluation every 2 steps feeds the dashboard's held-out accuracy panel.
         "experiment.eval_every=2",
         "observability.linger_s=120"]


@dataclass
class ScrapedRun:
    server: PrometheusServer
    run: str
    run_dir: Path
    records: list[dict[str, Any]]
    final_scrape: float  # unix time of the scrape that read the run's final values
    gpu: bool
    config_check: str
    log: str


def _dashboard_exprs() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target of every panel."""
    dash = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in dash["panels"] if p.get("type") != "row" for t in p.get("targets", [])]


def _run_driver(workdir: Path, run: str, port: int) -> str:
    """Run `miles-lite train` to the end with its exporter on `port`; returns its output."""
    log_path = workdir / "driver.log"
    # An evaluation set (GSM8K-format questions) feeds the dashboard's evaluation-set panel.
    dev = workdir / "dev.jsonl"
    dev.write_text("".join(json.dumps({"question": f"What is {a} + {b}?", "answer": f"{a} + {b}\n#### {a + b}"}) + "\n"
                           for a, b in ((2, 3), (4, 1), (6, 2))))
    cmd = [sys.executable, "-m", "miles_lite.cli", "train", f"experiment.output_dir={workdir}",
           f"experiment.run_name={run}", f"observability.metrics_port={port}", *SHORT,
           f"+data.eval_sets={{dev: {{path: {dev}, k: 2, temperature: 1.0}}}}"]
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            code = proc.wait(RUN_TIMEOUT_S)
        finally:
            if proc.poll() is None:  # timed out or interrupted: SIGTERM stops the run cleanly
                proc.terminate()
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
    out = log_path.read_text(errors="replace")
    assert code == 0, out[-4000:]
    return out


@pytest.fixture(scope="module")
def scraped_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ScrapedRun]:
    try:
        binary, promtool = ensure_prometheus_installed()
    except PrometheusUnavailable as err:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the Prometheus test: {err}")
        pytest.skip(str(err))
    run = f"itest-{uuid.uuid4().hex[:8]}"
    workdir = tmp_path_factory.mktemp("prometheus")
    port = free_port(LOCAL_HOST)
    server = PrometheusServer(workdir, [f"127.0.0.1:{port}"], binary, promtool, scrape_interval=SCRAPE_INTERVAL)
    config_check = server.check_config()
    server.start()
    try:
        log = _run_driver(workdir, run, port)
        run_dir = workdir / run
        records = read_metrics_file(run_dir)
        step = f'miles_lite_step{{run="{run}"}}'
        ckpt = f'miles_lite_checkpoint_step{{run="{run}"}}'
        # The run ended after its exporter served the final values; wait until Prometheus has stored them.
        server.wait_for(lambda: [v for _, v in server.raw_samples(step)][-1:] == [records[-1]["step"]]
                        and [v for _, v in server.raw_samples(ckpt)][-1:] == [STEPS], 30.0,
                        "the final step and checkpoint stored")
        final_scrape = server.raw_samples(step)[-1][0]
        yield ScrapedRun(server, run, run_dir, records, final_scrape, nvml_collector(run, "driver") is not None,
                         config_check, log)
    finally:
        server.stop()


def test_promtool_accepts_generated_config(scraped_run: ScrapedRun) -> None:
    assert "SUCCESS" in scraped_run.config_check


def test_the_run_was_scraped_while_alive_and_lingered_for_its_final_values(scraped_run: ScrapedRun) -> None:
    server, run = scraped_run.server, scraped_run.run
    up = server.raw_samples('up{job="miles-lite"}')
    # Scraped during the run, not once at its end. How many scrapes (SCRAPE_INTERVAL apart) fit depends on
    # the machine: the exporter was up for 1-2 s of an idle machine's run, several seconds of a loaded one's.
    before_final = [t for t, v in up if v == 1.0 and t < scraped_run.final_scrape]
    assert len(before_final) >= 2, up
    assert [v for t, v in up if t == scraped_run.final_scrape] == [1.0]
    steps = [v for _, v in server.raw_samples(f'miles_lite_step{{run="{run}"}}')]
    assert len(steps) >= 2 and steps == sorted(steps) and steps[-1] == STEPS, steps
    log = " ".join(scraped_run.log.split())  # the console wraps long lines
    assert "waiting up to 120 s for a scrape of the final metrics" in log
    assert "no scrape within" not in log


def test_every_dashboard_query_returns_data(scraped_run: ScrapedRun) -> None:
    exprs = _dashboard_exprs()
    assert len(exprs) >= 30
    empty, non_finite = [], []
    checked = 0
    for title, expr in exprs:
        if GPU_METRIC_PREFIX in expr and not scraped_run.gpu:
            continue  # NVML absent: GPU series are not exported at all (never faked).
        if MOE_METRIC_PREFIX in expr or any(name in expr for name in AGENT_METRICS):
            continue
        promql = expr.replace("$run", scraped_run.run).replace("$__rate_interval", "1m")
        result = scraped_run.server.query(promql, at=scraped_run.final_scrape)
        checked += 1
        if not result:
            empty.append((title, promql))
        elif not any(math.isfinite(float(r["value"][1])) for r in result):
            non_finite.append((title, promql, result))
    assert checked >= 33
    assert not empty, f"panels without data: {empty}"
    assert not non_finite, f"panels with only NaN/inf: {non_finite}"


def test_scraped_values_match_the_run(scraped_run: ScrapedRun) -> None:
    server, run, records = scraped_run.server, scraped_run.run, scraped_run.records
    last = records[-1]

    def value(name: str, **labels: str) -> float:
        sel = ",".join(f'{k}="{v}"' for k, v in {"run": run, "role": "driver", **labels}.items())
        result = server.query(f"{name}{{{sel}}}", at=scraped_run.final_scrape)
        assert len(result) == 1, (name, labels, result)
        return float(result[0]["value"][1])

    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert value("miles_lite_step") == STEPS
    for metric, key, labels in [
        ("miles_lite_reward_mean", "reward/mean", {}),
        ("miles_lite_reward_std", "reward/std", {}),
        ("miles_lite_exact_accuracy_ratio", "reward/exact_accuracy", {}),
        ("miles_lite_zero_signal_groups_ratio", "algo/zero_signal_share", {}),
        ("miles_lite_is_ratio_mean", "mismatch/is_raw_mean", {"kind": "raw"}),
        ("miles_lite_is_ratio_mean", "mismatch/is_applied_mean", {"kind": "applied"}),
        ("miles_lite_logp_diff_max_nats", "mismatch/logp_abs_diff_max", {}),
        ("miles_lite_loss", "loss/total", {}),
        ("miles_lite_entropy_nats", "entropy", {}),
        ("miles_lite_kl_nats", "kl/ref_k3", {}),
        ("miles_lite_grad_norm", "grad_norm", {}),
        ("miles_lite_weight_version", "weight_version", {}),
        ("miles_lite_rollout_tokens_per_second", "rollout/tokens_per_second", {}),
        ("miles_lite_probe_logp_diff_nats", "sync/probe_logp_diff_mean", {}),
        ("miles_lite_weight_sync_seconds", "sync/seconds", {"transport": "distributed"}),
    ]:
        assert value(metric, **labels) == pytest.approx(last[key], rel=1e-9, abs=1e-12), (metric, key)
    assert value("miles_lite_rollout_generated_tokens_total") == sum(r["rollout/generated_tokens"] for r in records)
    # One push after the warm-up, then one per step, every one of the full model.
    assert value("miles_lite_weight_syncs_total", transport="distributed") == STEPS + 1
    assert value("miles_lite_weight_sync_bytes_total", transport="distributed") == (STEPS + 1) * last["sync/bytes"]
    # Every completion was scored once per reward function; the rollout table holds all of them.
    completions = len(read_rollouts(scraped_run.run_dir))
    assert completions == STEPS * PROMPTS * GROUP
    assert value("miles_lite_reward_value_count", reward="exact_check") == completions
    # The per-step gauges the reward and latency panels plot hold the last step's values.
    exact_mean = value("miles_lite_reward_function_mean", reward="exact_check")
    assert exact_mean == pytest.approx(last["reward/exact_accuracy"])
    p50, p95 = (value("miles_lite_rollout_request_latency_quantile_seconds", quantile=q) for q in ("0.5", "0.95"))
    assert 0 < p50 <= p95
    # The final checkpoint is step STEPS's async one, committed before the run ended.
    assert value("miles_lite_checkpoint_step") == STEPS
    assert value("miles_lite_checkpoints_total") >= 1
    assert value("miles_lite_checkpoint_blocked_seconds") > 0 and value("miles_lite_checkpoint_flush_seconds") > 0
    assert value("miles_lite_checkpoint_bytes") > 0
    states = {r["metric"]["state"]: float(r["value"][1])
              for r in server.query(f'miles_lite_engines{{run="{run}"}}', at=scraped_run.final_scrape)}
    assert states == {s: (2.0 if s == "healthy" else 0.0) for s in ENGINE_STATES}
    assert value("miles_lite_engine_restarts_total") == 0
    assert value("miles_lite_nonfinite_skipped_steps_total") == 0


def test_run_variable_lists_the_run(scraped_run: ScrapedRun) -> None:
    dash = json.loads(DASHBOARD.read_text())
    variable = next(v for v in dash["templating"]["list"] if v["name"] == "run")
    assert variable["query"]["query"] == "label_values(miles_lite_step, run)"
    assert scraped_run.run in scraped_run.server.label_values("run", "miles_lite_step")
