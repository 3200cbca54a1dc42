"""Wait until a Ray cluster has registered the nodes and resources a Slurm job started for it.

    python wait_ray.py --address HOST:PORT --nodes 3 --expect miles_trainer=4 --expect miles_rollout=4 \
        --timeout 300 --watch-pid 1234:logs/ray-rollout.log

Exit 0 once at least `--nodes` nodes are alive and every `--expect NAME=AMOUNT` is met by the sum of
the alive nodes' total resources. Exit 1 with a message naming what is missing (and the log to read)
when the timeout passes or a watched process (the `srun` of a role) exits first.

Reads node state from the GCS directly (`ray._raylet.GcsClient`) instead of connecting a driver:
no job is registered and no local raylet is needed, and each poll is one RPC.
"""

from __future__ import annotations

import argparse
import socket
import sys
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class ClusterView:
    """Alive nodes and the sum of their total resources (resource name -> amount)."""

    alive_nodes: int
    resources: dict[str, float]


def parse_expect(items: list[str]) -> dict[str, float]:
    """`["miles_trainer=4", ...]` -> `{"miles_trainer": 4.0}`; raises ValueError naming a bad item."""
    expected: dict[str, float] = {}
    for item in items:
        name, sep, amount = item.partition("=")
        try:
            value = float(amount)
        except ValueError:
            value = -1.0
        if not sep or not name or value < 0:
            raise ValueError(f"--expect {item!r}: use NAME=AMOUNT with AMOUNT a number >= 0, e.g. miles_trainer=4")
        expected[name] = expected.get(name, 0.0) + value
    return expected


def parse_watch(items: list[str]) -> dict[int, str]:
    """`["1234:logs/ray-head.log"]` -> `{1234: "logs/ray-head.log"}`; raises ValueError on a bad pid."""
    watched: dict[int, str] = {}
    for item in items:
        pid, _, label = item.partition(":")
        if not pid.isdigit():
            raise ValueError(f"--watch-pid {item!r}: use PID or PID:LABEL with PID a positive integer")
        watched[int(pid)] = label or f"pid {pid}"
    return watched


def shortfall(view: ClusterView, nodes: int, expected: dict[str, float]) -> list[str]:
    """What `view` lacks against the expectation, as readable phrases; empty when satisfied."""
    missing = []
    if view.alive_nodes < nodes:
        missing.append(f"{nodes - view.alive_nodes} of {nodes} nodes")
    for name, amount in sorted(expected.items()):
        have = view.resources.get(name, 0.0)
        if have + 1e-9 < amount:
            missing.append(f"{name} {have:g}/{amount:g}")
    return missing


def process_alive(pid: int) -> bool:
    """True while `pid` runs and is not a zombie (an exited child not yet reaped by its parent)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def tcp_open(address: str, timeout_s: float = 2.0) -> bool:
    """True when HOST:PORT accepts a TCP connection."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False


class GcsProbe:
    """Polls node info from the GCS at `address` (HOST:PORT); connects lazily, retries until it answers."""

    def __init__(self, address: str) -> None:
        self.address = address
        self._client = None

    def view(self, rpc_timeout_s: float = 5.0) -> ClusterView | None:
        """The current alive nodes and resources, or None while the GCS does not answer."""
        from ray._raylet import GcsClient

        if self._client is None and not tcp_open(self.address):
            return None  # the client would log a connection error to stderr on every poll
        try:
            if self._client is None:
                self._client = GcsClient(address=self.address)
            infos = self._client.get_all_node_info(timeout=rpc_timeout_s)
        except Exception:  # the GCS may not be up yet; any RPC failure means "ask again"
            self._client = None
            return None
        alive = 0
        total: dict[str, float] = {}
        for info in infos.values():
            if info.state != 0:  # GcsNodeInfo.ALIVE == 0
                continue
            alive += 1
            for name, amount in dict(info.resources_total).items():
                total[name] = total.get(name, 0.0) + float(amount)
        return ClusterView(alive, total)


def wait(address: str, nodes: int, expected: dict[str, float], timeout_s: float, watched: dict[int, str],
         poll_s: float = 1.0) -> ClusterView:
    """Poll until satisfied; raises TimeoutError or RuntimeError (a watched process exited) with details."""
    probe = GcsProbe(address)
    deadline = time.monotonic() + timeout_s
    view: ClusterView | None = None
    while True:
        view = probe.view() or view
        if view is not None and not shortfall(view, nodes, expected):
            return view
        for pid, label in watched.items():
            if not process_alive(pid):
                raise RuntimeError(f"the process starting Ray ({label}) exited before the cluster was complete; "
                                   f"missing {describe(view, nodes, expected)}; read {label}")
        if time.monotonic() >= deadline:
            raise TimeoutError(f"Ray at {address} incomplete after {timeout_s:.0f} s: missing "
                               f"{describe(view, nodes, expected)}; read the ray-*.log files of the run. Raise "
                               f"MILES_RAY_READY_TIMEOUT if nodes are merely slow to start")
        time.sleep(poll_s)


def describe(view: ClusterView | None, nodes: int, expected: dict[str, float]) -> str:
    if view is None:
        return "everything (the GCS never answered)"
    return ", ".join(shortfall(view, nodes, expected)) + f" (alive nodes: {view.alive_nodes})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--address", required=True, help="GCS address HOST:PORT of the head")
    parser.add_argument("--nodes", type=int, default=1, help="alive nodes required")
    parser.add_argument("--expect", action="append", default=[], help="NAME=AMOUNT of a resource, repeatable")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds before giving up")
    parser.add_argument("--watch-pid", action="append", default=[], help="PID[:LABEL]; fail when it exits")
    args = parser.parse_args(argv)
    try:
        expected, watched = parse_expect(args.expect), parse_watch(args.watch_pid)
    except ValueError as err:
        parser.error(str(err))
    if args.nodes < 1 or args.timeout <= 0:
        parser.error("--nodes must be >= 1 and --timeout > 0")
    start = time.monotonic()
    try:
        view = wait(args.address, args.nodes, expected, args.timeout, watched)
    except (TimeoutError, RuntimeError) as err:
        print(f"wait_ray: {err}", file=sys.stderr, flush=True)
        return 1
    have = ", ".join(f"{k}={view.resources.get(k, 0):g}" for k in sorted(expected))
    print(f"wait_ray: {view.alive_nodes} nodes alive ({have}) after {time.monotonic() - start:.1f} s",
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
