"""The Grafana dashboard JSON: structure, variables, layout, and coverage of every exported metric.

Each panel's PromQL is executed against a real Prometheus in tests/integration/test_prometheus.py.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from miles_lite.observability import MetricsRegistry
from miles_lite.observability.gpu import MEMORY_METRIC, MEMORY_TOTAL_METRIC, UTIL_METRIC

DASHBOARD = Path(__file__).resolve().parents[2] / "k8s" / "grafana" / "miles-lite.json"
NAME_RE = re.compile(r"\bmiles_lite_[a-z0-9_]+")


@pytest.fixture(scope="module")
def dash() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def panels(dash: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in dash["panels"] if p["type"] != "row"]


def exprs(dash: dict[str, Any]) -> list[str]:
    return [t["expr"] for p in panels(dash) for t in p["targets"]]


def exported_series() -> set[str]:
    """Every series name the registry (and the NVML collector) can expose."""
    reg = MetricsRegistry("r", "driver")
    names = set()
    for family in reg.registry.collect():
        if family.type == "counter":
            names.add(family.name + "_total")
        elif family.type == "histogram":
            names.update(family.name + s for s in ("_bucket", "_sum", "_count"))
        else:
            names.add(family.name)
    return names | {UTIL_METRIC, MEMORY_METRIC, MEMORY_TOTAL_METRIC}


def test_model_basics(dash: dict[str, Any]) -> None:
    assert dash["schemaVersion"] >= 39
    assert dash["uid"] == "miles-lite" and dash["title"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    titles = [p["title"] for p in panels(dash)]
    assert len(titles) == len(set(titles))
    for p in panels(dash):
        assert p["type"] == "timeseries"
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert p["description"], p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert refs and len(refs) == len(set(refs))


def test_variables(dash: dict[str, Any]) -> None:
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    run = variables["run"]
    assert run["type"] == "query" and run["multi"] and run["includeAll"]
    assert run["datasource"]["uid"] == "${datasource}"
    for expr in exprs(dash):
        # Every query is filtered by the run variable (regex match so "All" and multi-select work).
        for selector in re.findall(r"miles_lite_[a-z0-9_]+(\{[^}]*\})?", expr):
            assert 'run=~"$run"' in selector, expr


def test_layout_has_no_overlaps(dash: dict[str, Any]) -> None:
    cells: set[tuple[int, int]] = set()
    for p in dash["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']} overlaps at {(x, y)}"
                cells.add((x, y))


def test_mismatch_panels_come_first(dash: dict[str, Any]) -> None:
    rows = sorted((p for p in dash["panels"] if p["type"] == "row"), key=lambda p: p["gridPos"]["y"])
    first_row_y, second_row_y = rows[0]["gridPos"]["y"], rows[1]["gridPos"]["y"]
    first = [p for p in panels(dash) if first_row_y < p["gridPos"]["y"] < second_row_y]
    first_exprs = " ".join(t["expr"] for p in first for t in p["targets"])
    for name in ("miles_lite_logp_diff_mean_nats", "miles_lite_logp_diff_max_nats", "miles_lite_is_ratio_mean",
                 "miles_lite_is_masked_tokens_ratio", "miles_lite_probe_logp_diff_nats"):
        assert name in first_exprs, name
    assert "mismatch" in rows[0]["title"].lower()


def test_every_metric_has_a_panel_and_every_name_exists(dash: dict[str, Any]) -> None:
    used = {name for expr in exprs(dash) for name in NAME_RE.findall(expr)}
    known = exported_series()
    assert not used - known, f"dashboard queries unknown series: {sorted(used - known)}"
    families = set(MetricsRegistry("r", "driver").metric_names()) | {UTIL_METRIC, MEMORY_METRIC}
    unused = {f for f in families if not any(u == f or u.startswith(f + "_") and u[len(f):] in
                                             ("_bucket", "_sum", "_count") for u in used)}
    assert not unused, f"metrics without a panel: {sorted(unused)}"
