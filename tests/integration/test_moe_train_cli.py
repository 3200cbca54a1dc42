"""`miles-lite train model=tiny_qwen3_moe trainer.routing_replay=true` on CPU: reference engines return the
routed experts, samples carry them to the trainer, weight pushes (every expert) are verified by the probe, and
the router statistics reach the run's Prometheus exporter."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from miles_lite.net.ports import LOCAL_HOST, free_port

pytestmark = pytest.mark.timeout(900)


class Scraper:
    """Scrapes an exporter every 0.2 s while a run is alive, keeping the last answer (what Prometheus would
    store last: the run lingers until a scrape after its final step was served)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.last = ""
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self.stop.wait(0.2):
            try:
                with urllib.request.urlopen(self.url, timeout=2) as resp:
                    self.last = resp.read().decode()
            except (urllib.error.URLError, OSError):
                continue

    def samples(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("run", "role")))): s.value
                for family in text_string_to_metric_families(self.last) for s in family.samples}


def test_moe_run_with_routing_replay(tmp_path: Path) -> None:
    port = free_port(LOCAL_HOST)
    cmd = [sys.executable, "-m", "miles_lite.cli", "train", "model=tiny_qwen3_moe", "trainer.routing_replay=true",
           "experiment.warmup=none", "experiment.steps=2", "algo.drop_zero_signal=false",
           "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=8",
           "data.synthetic.eval_size=20", f"experiment.output_dir={tmp_path}", "experiment.run_name=run",
           "observability.progress=false", f"observability.metrics_port={port}", "observability.linger_s=60"]
    scraper = Scraper(f"http://{LOCAL_HOST}:{port}/metrics")
    scraper.thread.start()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=800)
    finally:
        scraper.stop.set()
        scraper.thread.join()
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    trained = [s for s in steps if "moe/router_agreement" in s]
    assert len(trained) == 2, [sorted(k for k in s if k.startswith("moe/")) for s in steps]
    for stats in trained:
        # The rollout's routing reached the trainer: the engines ran the pushed weights, so the trainer's
        # routers mostly pick what they picked (ties and float noise aside).
        assert stats["moe/router_agreement"] > 0.9
        for layer in (1, 2):  # layer 0 is dense
            assert 0.125 <= stats[f"moe/layer{layer}/load_max_share"] <= 1.0
            assert stats[f"moe/layer{layer}/load_cv"] >= 0.0
        assert "moe/layer0/load_cv" not in stats
        assert stats["moe/aux_loss"] > 0.0
        assert stats["sync/probe_logp_diff_max"] < 1e-4  # every push verified, experts included
        assert stats["mismatch/logp_abs_diff_mean"] < 1e-3
    # The exporter served the last step's router statistics, under their Prometheus names.
    scraped, last = scraper.samples(), trained[-1]
    assert scraped[("miles_lite_step", ())] == last["step"]
    assert scraped[("miles_lite_moe_router_agreement_ratio", ())] == pytest.approx(last["moe/router_agreement"])
    assert scraped[("miles_lite_moe_aux_loss", ())] == pytest.approx(last["moe/aux_loss"])
    for layer in ("1", "2"):
        assert scraped[("miles_lite_moe_expert_load_max_share_ratio", (("layer", layer),))] == pytest.approx(
            last[f"moe/layer{layer}/load_max_share"])
        assert scraped[("miles_lite_moe_expert_load_cv", (("layer", layer),))] == pytest.approx(
            last[f"moe/layer{layer}/load_cv"])
    assert scraped[("miles_lite_moe_expert_load_cv", (("layer", "mean"),))] == pytest.approx(last["moe/load_cv"])
    assert ("miles_lite_moe_expert_load_cv", (("layer", "0"),)) not in scraped
