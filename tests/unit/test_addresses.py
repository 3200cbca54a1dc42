"""Addresses: the route toward a peer, engine URL hosts, the advertise override, and no loopback in the cluster path."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from miles_lite.net.ports import AddressError, free_port, is_loopback, node_address, route_address, url_host

REPO = Path(__file__).resolve().parents[2]
# Everything a cluster run executes to place roles, start engines and connect them. `miles_lite/net/ports.py`
# names loopback once, for cluster=local.
CLUSTER_PATH = ("miles_lite/cluster", "miles_lite/rollout", "miles_lite/engines", "miles_lite/weight_sync",
                "miles_lite/run/system.py", "slurm", "launcher")
LOOPBACK = re.compile(r"127\.0\.0\.1|\blocalhost\b|\[::1\]|'::1'|\"::1\"")


def _cluster_files() -> list[Path]:
    files: list[Path] = []
    for entry in CLUSTER_PATH:
        path = REPO / entry
        files += [path] if path.is_file() else [p for p in path.rglob("*") if p.suffix in (".py", ".sh")]
    return files


def test_no_module_in_the_cluster_path_hard_codes_a_loopback_address():
    files = _cluster_files()
    assert len(files) > 30 and REPO / "miles_lite/cluster/ray_trainer.py" in files
    hits = [f"{p.relative_to(REPO)}:{n}: {line.strip()}" for p in files
            for n, line in enumerate(p.read_text().splitlines(), 1) if LOOPBACK.search(line)]
    assert not hits, "loopback in the cluster path (use the node's address, or ports.LOCAL_HOST for cluster=local):\n" \
        + "\n".join(hits)


def test_the_scan_sees_a_loopback_literal(tmp_path: Path):
    assert LOOPBACK.search('host: str = "127.0.0.1"') and LOOPBACK.search("curl http://localhost:8000")
    assert not LOOPBACK.search('bind "0.0.0.0"') and not LOOPBACK.search("127.0.0.2")


def test_route_address_is_the_source_address_a_peer_sees():
    # Every 127/8 address is this host: the kernel answers from loopback toward another loopback address.
    assert is_loopback(route_address("127.0.0.2"))
    assert url_host("http://10.1.2.3:30000/") == "10.1.2.3" and url_host("engine-0.svc:30000") == "engine-0.svc"


def test_node_address_prefers_advertise_then_route_then_fallback():
    assert node_address("trainer-0.miles.svc", ["127.0.0.2"]) == "trainer-0.miles.svc"
    assert is_loopback(node_address(None, ["127.0.0.2"]))
    assert node_address(None, [], fallback="192.0.2.7") == "192.0.2.7"
    with pytest.raises(AddressError, match="cluster.advertise_address"):
        node_address(None, [])


def test_free_port_binds_on_all_interfaces():
    assert 0 < free_port("") < 65536
