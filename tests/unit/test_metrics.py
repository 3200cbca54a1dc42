"""MetricsRegistry mapping of the driver's stats dict, event methods, and the HTTP exporter."""

from __future__ import annotations

import socket
import threading
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from miles_lite.config.schema import ObservabilityConfig
from miles_lite.observability import (
    ENGINE_STATES,
    PHASES,
    ExporterState,
    MetricsExporter,
    MetricsRegistry,
    nvml_collector,
    start_exporter,
)
from miles_lite.observability.metrics import _SCALAR_KEYS


def samples(registry: MetricsRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(sample name, sorted labels): value} parsed back from the text exposition."""
    out = {}
    for family in text_string_to_metric_families(registry.exposition().decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def lab(**extra: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted({"run": "r1", "role": "driver", **extra}.items()))


def test_every_scalar_key_reaches_its_metric() -> None:
    reg = MetricsRegistry("r1", "driver")
    stats = {key: float(i + 1) for i, key in enumerate(_SCALAR_KEYS)}
    reg.publish_step(7, stats)
    got = samples(reg)
    expected = {
        "rollout/tokens_per_second": ("miles_lite_rollout_tokens_per_second", lab()),
        "rollout/generated_tokens": ("miles_lite_rollout_generated_tokens_total", lab()),
        "rollout/retried_requests": ("miles_lite_rollout_retried_requests_total", lab()),
        "rollout/dynamic_sampling_rounds": ("miles_lite_dynamic_sampling_rounds", lab()),
        "rollout/stale_dropped": ("miles_lite_stale_dropped_groups_total", lab()),
        "rollout/mixed_version_samples": ("miles_lite_mixed_version_samples_total", lab()),
        "rollout/staleness_mean": ("miles_lite_staleness_versions", lab(stat="mean")),
        "rollout/staleness_max": ("miles_lite_staleness_versions", lab(stat="max")),
        "rollout/agents_failed": ("miles_lite_agents_dropped_total", lab(reason="failed")),
        "rollout/agent_timeouts": ("miles_lite_agents_dropped_total", lab(reason="timeout")),
        "rollout/tito_mismatch": ("miles_lite_session_tito_mismatch_total", lab()),
        "rollout/session_engine_moves": ("miles_lite_session_engine_moves_total", lab()),
        "rollout/session_diverged": ("miles_lite_session_diverged_requests_total", lab()),
        "reward/mean": ("miles_lite_reward_mean", lab()),
        "reward/std": ("miles_lite_reward_std", lab()),
        "reward/exact_accuracy": ("miles_lite_exact_accuracy_ratio", lab()),
        "algo/zero_signal_share": ("miles_lite_zero_signal_groups_ratio", lab()),
        "kl/ref_k3": ("miles_lite_kl_nats", lab()),
        "entropy": ("miles_lite_entropy_nats", lab()),
        "grad_norm": ("miles_lite_grad_norm", lab()),
        "loss/total": ("miles_lite_loss", lab()),
        "skipped": ("miles_lite_nonfinite_skipped_steps_total", lab()),
        "mismatch/logp_abs_diff_mean": ("miles_lite_logp_diff_mean_nats", lab()),
        "mismatch/logp_abs_diff_max": ("miles_lite_logp_diff_max_nats", lab()),
        "mismatch/is_raw_mean": ("miles_lite_is_ratio_mean", lab(kind="raw")),
        "mismatch/is_applied_mean": ("miles_lite_is_ratio_mean", lab(kind="applied")),
        "mismatch/masked_fraction": ("miles_lite_is_masked_tokens_ratio", lab()),
        "weight_version": ("miles_lite_weight_version", lab()),
        **{f"time/{p}_seconds": ("miles_lite_step_phase_seconds", lab(phase=p)) for p in PHASES},
        **{f"eval/{m}": ("miles_lite_held_out_accuracy_ratio", lab(measure=m))
           for m in ("exact", "exact_format", "right_number_in_solution", "right_number_anywhere")},
        "moe/router_agreement": ("miles_lite_moe_router_agreement_ratio", lab()),
        "moe/load_max_share": ("miles_lite_moe_expert_load_max_share_ratio", lab(layer="mean")),
        "moe/load_cv": ("miles_lite_moe_expert_load_cv", lab(layer="mean")),
        "moe/aux_loss": ("miles_lite_moe_aux_loss", lab()),
    }
    assert set(expected) == set(_SCALAR_KEYS)
    for key, sample in expected.items():
        assert got[sample] == stats[key], key
    assert got[("miles_lite_step", lab())] == 7


def test_moe_layer_keys_become_layer_labels_on_the_scraped_endpoint() -> None:
    """The router statistics the trainer returns every step, as `/metrics` serves them."""
    reg = MetricsRegistry("r1", "driver")
    stats = {"moe/router_agreement": 0.875, "moe/layer1/load_max_share": 0.25, "moe/layer1/load_cv": 0.5,
             "moe/layer2/load_max_share": 0.375, "moe/layer2/load_cv": 0.75, "moe/load_max_share": 0.3125,
             "moe/load_cv": 0.625, "moe/aux_loss": 1.125, "moe/layer3/other": 9.0}
    reg.publish_step(3, stats)
    with MetricsExporter(reg) as exp:
        with urllib.request.urlopen(exp.url, timeout=5) as resp:
            text = resp.read().decode()
    got = {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("run", "role")))): s.value
           for family in text_string_to_metric_families(text) for s in family.samples}
    assert got[("miles_lite_moe_router_agreement_ratio", ())] == 0.875
    assert got[("miles_lite_moe_aux_loss", ())] == 1.125
    for layer, share, cv in (("1", 0.25, 0.5), ("2", 0.375, 0.75), ("mean", 0.3125, 0.625)):
        assert got[("miles_lite_moe_expert_load_max_share_ratio", (("layer", layer),))] == share
        assert got[("miles_lite_moe_expert_load_cv", (("layer", layer),))] == cv
    # Only the two per-layer measures map; another key under a layer is left to metrics.jsonl.
    assert not any(labels == (("layer", "3"),) for _, labels in got)
    with pytest.raises(TypeError, match="moe/layer1/load_cv"):
        reg.publish_step(4, {"moe/layer1/load_cv": "high"})


def test_counters_accumulate_and_gauges_overwrite() -> None:
    reg = MetricsRegistry("r1", "driver")
    reg.publish_step(1, {"rollout/generated_tokens": 100, "reward/mean": 1.5})
    reg.publish_step(2, {"rollout/generated_tokens": 50, "reward/mean": 0.5})
    got = samples(reg)
    assert got[("miles_lite_rollout_generated_tokens_total", lab())] == 150
    assert got[("miles_lite_reward_mean", lab())] == 0.5
    assert got[("miles_lite_step", lab())] == 2


def test_list_keys_feed_histograms() -> None:
    reg = MetricsRegistry("r1", "driver")
    reg.publish_step(1, {"rollout/request_latency_seconds": [0.02, 0.3, 4.0],
                         "reward/values/exact_check": [0.0, 1.0, 1.0, 0.0],
                         "reward/values/total": [0.5, 4.75, 5.25, -0.5]})
    got = samples(reg)
    assert got[("miles_lite_rollout_request_latency_seconds_count", lab())] == 3
    assert got[("miles_lite_rollout_request_latency_seconds_sum", lab())] == pytest.approx(4.32)
    assert got[("miles_lite_reward_value_count", lab(reward="exact_check"))] == 4
    assert got[("miles_lite_reward_value_sum", lab(reward="total"))] == pytest.approx(10.0)
    # A negative reward lands in the first bucket; `_sum` stays exported (needed for means).
    assert got[("miles_lite_reward_value_bucket", lab(reward="total", le="0.0"))] == 1
    # The per-step gauges: the step's own mean per function and latency quantiles (interpolated).
    assert got[("miles_lite_reward_function_mean", lab(reward="exact_check"))] == 0.5
    assert got[("miles_lite_reward_function_mean", lab(reward="total"))] == 2.5
    assert got[("miles_lite_rollout_request_latency_quantile_seconds", lab(quantile="0.5"))] == pytest.approx(0.3)
    assert got[("miles_lite_rollout_request_latency_quantile_seconds", lab(quantile="0.95"))] == pytest.approx(3.63)
    # The next step overwrites the gauges with its own values while the histograms keep accumulating; a
    # step without values leaves the last ones.
    reg.publish_step(2, {"rollout/request_latency_seconds": [1.0], "reward/values/exact_check": [1.0, 1.0],
                         "reward/values/total": []})
    got = samples(reg)
    assert got[("miles_lite_reward_function_mean", lab(reward="exact_check"))] == 1.0
    assert got[("miles_lite_reward_function_mean", lab(reward="total"))] == 2.5
    assert got[("miles_lite_reward_value_count", lab(reward="exact_check"))] == 6
    for q in ("0.5", "0.95"):
        assert got[("miles_lite_rollout_request_latency_quantile_seconds", lab(quantile=q))] == 1.0


def test_unknown_keys_are_ignored_and_bad_values_name_the_key() -> None:
    reg = MetricsRegistry("r1", "driver")
    reg.publish_step(1, {"policy/clip_frac_low": 0.1, "note": "anything"})
    with pytest.raises(TypeError, match="reward/mean"):
        reg.publish_step(2, {"reward/mean": "high"})
    with pytest.raises(TypeError, match="rollout/request_latency_seconds"):
        reg.publish_step(2, {"rollout/request_latency_seconds": 0.5})
    with pytest.raises(ValueError, match="rollout/generated_tokens"):
        reg.publish_step(2, {"rollout/generated_tokens": -3})
    with pytest.raises(ValueError, match="reward function name"):
        reg.publish_step(2, {"reward/values/": [1.0]})
    with pytest.raises(ValueError, match="step"):
        reg.publish_step(-1, {})


def test_constructor_validates_run_and_role() -> None:
    with pytest.raises(ValueError, match="role"):
        MetricsRegistry("r1", "learner")
    with pytest.raises(ValueError, match="run"):
        MetricsRegistry("", "driver")


def test_events() -> None:
    reg = MetricsRegistry("r1", "rollout")
    rl = {"run": "r1", "role": "rollout"}

    def key(name: str, **extra: str) -> tuple[str, tuple[tuple[str, str], ...]]:
        return name, tuple(sorted({**rl, **extra}.items()))

    reg.set_engine_states({"healthy": 3, "dead": 1})
    reg.engine_restarted()
    reg.sync_done("disk", 1.5, 1000, version=4, probe_logp_diff=2e-4)
    reg.sync_done("disk", 0.5, 500, version=5)
    reg.checkpoint_blocked(0.3)
    reg.checkpoint_committed(2.0, 4096, step=7)
    got = samples(reg)
    assert {s: got[key("miles_lite_engines", state=s)] for s in ENGINE_STATES} == {
        "starting": 0, "healthy": 3, "dead": 1, "replacing": 0, "stale": 0, "sleeping": 0}
    assert got[key("miles_lite_engine_restarts_total")] == 1
    assert got[key("miles_lite_weight_sync_seconds", transport="disk")] == 0.5
    assert got[key("miles_lite_weight_sync_bytes_total", transport="disk")] == 1500
    assert got[key("miles_lite_weight_syncs_total", transport="disk")] == 2
    assert got[key("miles_lite_weight_version")] == 5
    assert got[key("miles_lite_probe_logp_diff_nats")] == 2e-4
    assert got[key("miles_lite_checkpoint_blocked_seconds")] == 0.3
    assert got[key("miles_lite_checkpoint_step")] == 7
    assert got[key("miles_lite_checkpoint_flush_seconds")] == 2.0
    assert got[key("miles_lite_checkpoint_bytes")] == 4096
    assert got[key("miles_lite_checkpoints_total")] == 1
    with pytest.raises(ValueError, match="zombie"):
        reg.set_engine_states({"zombie": 1})
    with pytest.raises(ValueError, match="transport"):
        reg.sync_done("carrier-pigeon", 1.0, 1, 1)


def test_names_units_labels_and_no_global_registry() -> None:
    a, b = MetricsRegistry("run-a", "trainer"), MetricsRegistry("run-b", "driver")
    a.publish_step(1, {"reward/mean": 1.0})
    assert b"run-a" not in b.exposition()
    for family in text_string_to_metric_families(a.exposition().decode()):
        assert family.name.startswith("miles_lite_")
        assert family.documentation
        for s in family.samples:
            assert s.labels["run"] == "run-a" and s.labels["role"] == "trainer"
    names = a.metric_names()
    for unit_name in ("miles_lite_weight_sync_seconds", "miles_lite_weight_sync_bytes_total",
                      "miles_lite_rollout_tokens_per_second", "miles_lite_checkpoint_bytes",
                      "miles_lite_logp_diff_mean_nats", "miles_lite_exact_accuracy_ratio"):
        assert unit_name in names


def test_gpu_metrics_are_absent_without_nvml() -> None:
    try:
        import pynvml  # noqa: F401
    except ImportError:
        assert nvml_collector("r1", "trainer") is None
        reg = MetricsRegistry("r1", "trainer")
        assert b"miles_lite_gpu_" not in reg.exposition()
    else:
        pytest.skip("pynvml is installed; the GPU test in tests/gpu covers the collector")


def test_exporter_serves_and_stops() -> None:
    reg = MetricsRegistry("served", "driver")
    reg.publish_step(3, {"reward/mean": 2.0})
    exporter = MetricsExporter(reg, "127.0.0.1", 0)
    assert exporter.state is ExporterState.NEW
    port = exporter.start()
    assert port > 0 and exporter.state is ExporterState.RUNNING
    with urllib.request.urlopen(exporter.url, timeout=5) as resp:
        body = resp.read().decode()
    assert 'miles_lite_reward_mean{role="driver",run="served"} 2.0' in body
    with pytest.raises(RuntimeError, match="running"):
        exporter.start()
    exporter.stop()
    assert exporter.state is ExporterState.STOPPED
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)
    with pytest.raises(RuntimeError, match="stopped"):
        exporter.start()


def test_exporter_port_errors() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match="metrics_port"):
            MetricsExporter(MetricsRegistry("r", "driver"), "127.0.0.1", port).start()
    with pytest.raises(ValueError, match="metrics_port"):
        MetricsExporter(MetricsRegistry("r", "driver"), "127.0.0.1", 70000)


def test_start_exporter_follows_config() -> None:
    reg = MetricsRegistry("r", "driver")
    assert start_exporter(reg, ObservabilityConfig(metrics_enabled=False)) is None
    exporter = start_exporter(reg, ObservabilityConfig(metrics_port=0, metrics_host="127.0.0.1"))
    assert exporter is not None
    try:
        assert exporter.state is ExporterState.RUNNING and exporter.port > 0
    finally:
        exporter.stop()


def test_exporter_waits_for_a_scrape_of_the_final_values() -> None:
    reg = MetricsRegistry("linger", "driver")
    with MetricsExporter(reg, "127.0.0.1", 0) as exporter:
        assert exporter.scrapes_served == 0
        assert exporter.wait_for_scrape(0.2) is False  # nothing scrapes: the wait ends at its timeout
        reg.publish_step(9, {"reward/mean": 4.5})  # the run's final values
        bodies: list[str] = []
        stop = threading.Event()

        def scraper() -> None:  # a scraper with a 50 ms interval, like Prometheus with a short one
            while not stop.is_set():
                with urllib.request.urlopen(exporter.url, timeout=5) as resp:
                    bodies.append(resp.read().decode())
                stop.wait(0.05)

        thread = threading.Thread(target=scraper)
        thread.start()
        try:
            assert exporter.wait_for_scrape(10.0) is True
            served = exporter.scrapes_served
        finally:
            stop.set()
            thread.join(10)
        assert served >= 1 and bodies
        assert 'miles_lite_reward_mean{role="driver",run="linger"} 4.5' in bodies[0]
    with pytest.raises(RuntimeError, match="stopped"):
        exporter.wait_for_scrape(1.0)
    with pytest.raises(ValueError, match="linger_s"):
        start_exporter(reg, ObservabilityConfig(linger_s=-1.0))


def test_engine_restart_counter_exists_at_zero() -> None:
    reg = MetricsRegistry("r0", "driver")
    reg.engine_restarted(0)
    assert samples(reg)[("miles_lite_engine_restarts_total", lab(run="r0"))] == 0
    reg.engine_restarted(2)
    assert samples(reg)[("miles_lite_engine_restarts_total", lab(run="r0"))] == 2
    with pytest.raises(ValueError, match="count"):
        reg.engine_restarted(-1)


def test_evaluation_set_measures_are_one_gauge_labelled_by_set_and_measure():
    from prometheus_client import generate_latest

    from miles_lite.observability.metrics import MetricsRegistry

    reg = MetricsRegistry("run", "driver")
    reg.set_eval_sets({"eval/dev/avg@4": 0.25})
    reg.publish_step(3, {"eval/dev/pass@4": 0.5, "eval/exact": 0.75})
    samples = {(s.labels.get("set"), s.labels.get("measure")): s.value
               for family in text_string_to_metric_families(generate_latest(reg.registry).decode())
               if family.name == "miles_lite_eval_set_value" for s in family.samples}
    assert samples == {("dev", "avg@4"): 0.25, ("dev", "pass@4"): 0.5}


def test_exporter_is_read_only() -> None:
    reg = MetricsRegistry("ro", "driver")
    reg.publish_step(1, {"reward/mean": 1.0})
    with MetricsExporter(reg, "127.0.0.1", 0) as exporter:
        base = exporter.url.removesuffix("/metrics")
        for method, path, status in (("POST", "/metrics", 405), ("PUT", "/metrics", 405),
                                     ("DELETE", "/metrics", 405), ("GET", "/", 404), ("GET", "/debug", 404)):
            request = urllib.request.Request(base + path, data=b"x" if method != "GET" else None, method=method)
            with pytest.raises(urllib.error.HTTPError) as err:
                urllib.request.urlopen(request, timeout=5)
            assert err.value.code == status, (method, path)
        assert exporter.scrapes_served == 0  # refused requests are no scrapes
        with urllib.request.urlopen(exporter.url, timeout=5) as resp:
            assert resp.status == 200 and b"miles_lite_" in resp.read()


def test_metrics_host_node_binds_this_nodes_address(monkeypatch: pytest.MonkeyPatch) -> None:
    from miles_lite.net.ports import AddressError
    from miles_lite.observability import exporter as exporter_module

    assert exporter_module.bind_address("127.0.0.1") == "127.0.0.1"
    monkeypatch.setattr(exporter_module, "ray_node_address", lambda: None)
    monkeypatch.setattr(exporter_module.socket, "gethostbyname", lambda name: "10.1.2.3")
    assert exporter_module.bind_address("node") == "10.1.2.3"
    monkeypatch.setattr(exporter_module.socket, "gethostbyname", lambda name: "127.0.1.1")
    monkeypatch.setattr(exporter_module, "route_address", lambda peer: "10.4.5.6")
    assert exporter_module.bind_address("node") == "10.4.5.6"  # a name mapped to loopback: the default route's

    def no_route(peer: str) -> str:
        raise AddressError("no route")

    monkeypatch.setattr(exporter_module, "route_address", no_route)
    with pytest.raises(AddressError, match="observability.metrics_host"):
        exporter_module.bind_address("node")
    monkeypatch.setattr(exporter_module, "ray_node_address", lambda: "10.9.9.9")
    assert exporter_module.bind_address("node") == "10.9.9.9"
