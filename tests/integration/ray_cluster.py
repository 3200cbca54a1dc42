"""A real multi-node Ray cluster on one machine: each node a `ray start --block` process with its own node IP.

Loopback addresses other than 127.0.0.1 (127.0.0.2, ...) all reach this host, so a node started with
`--node-ip-address 127.0.0.2` is a separate Ray node with a separate address, as on a second host. Each
node gets explicit agent ports (two raylets on one host would otherwise collide on the dashboard
agent's default port). `stop()` ends only the processes started here: SIGTERM to each node's process
group (the foreground `ray start` stops its own daemons), SIGKILL after a grace period.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RAY = str(Path(sys.executable).with_name("ray"))


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


@dataclass
class LocalRayCluster:
    """Nodes started by `add_node`; `address` is the head's GCS address once the head runs."""

    root: Path
    address: str = ""
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def env(self) -> dict[str, str]:
        # No idle workers started ahead of demand: they would compete with the node's agents, which the
        # raylet gives a fixed start-up window.
        return {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "1",
                "RAY_enable_worker_prestart": "0", "RAY_prestart_worker_first_driver": "0"}

    def add_node(self, ip: str, role: str, cpus: int, resources: dict[str, float], head: bool = False,
                 attempts: int = 5) -> None:
        """Start a node at `ip` for `role` and wait until the cluster lists it with its resources.

        The node's processes see MILES_RAY_ROLE=`role`, as slurm/lib/ray_node.sh sets it.

        A loaded machine can miss the raylet's fixed wait for its agents (`ray start` then exits 1):
        such a start-up failure is retried, as slurm/lib/ray_node.sh does.
        """
        name = "head" if head else f"node-{len(self.procs)}"
        for attempt in range(1, attempts + 1):
            ports = _free_ports(5)
            args = [RAY, "start", "--block", "--disable-usage-stats", f"--node-ip-address={ip}",
                    f"--temp-dir={self.root / name}", f"--num-cpus={cpus}", "--num-gpus=0",
                    f"--resources={json.dumps(resources)}", "--object-store-memory=100000000",
                    f"--dashboard-agent-grpc-port={ports[0]}", f"--dashboard-agent-listen-port={ports[1]}",
                    f"--runtime-env-agent-port={ports[2]}", f"--metrics-export-port={ports[3]}",
                    "--include-log-monitor=false"]
            if head:
                args += ["--head", f"--port={ports[4]}", "--include-dashboard=false"]
                self.address = f"{ip}:{ports[4]}"
            else:
                args += [f"--address={self.address}"]
            log = self.root / f"{name}.log"
            with log.open("ab") as out:
                proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT,
                                        env={**self.env(), "MILES_RAY_ROLE": role}, start_new_session=True)
            self.procs.append(proc)
            expect = [f"--expect={k}={v}" for k, v in resources.items()]
            # Readiness from the GCS itself (the script slurm/train.sh waits with).
            ready = subprocess.run([sys.executable, str(REPO / "slurm/lib/wait_ray.py"), "--address", self.address,
                                    "--nodes", str(len(self.procs)), *expect, "--timeout", "120",
                                    "--watch-pid", f"{proc.pid}:{log}"], env=self.env(), timeout=150,
                                   capture_output=True, text=True)
            if ready.returncode == 0:
                return
            self.procs.remove(proc)
            _stop(proc, grace_s=10.0)
            if attempt == attempts:
                raise RuntimeError(f"Ray node {name} at {ip} did not start in {attempts} attempts: "
                                   f"{ready.stderr}\n{log.read_text(errors='replace')[-3000:]}")

    def stop(self, grace_s: float = 20.0) -> None:
        for proc in reversed(self.procs):
            _signal_group(proc.pid, signal.SIGTERM)
        for proc in reversed(self.procs):
            _stop(proc, grace_s)
        self.procs.clear()


def _stop(proc: subprocess.Popen[bytes], grace_s: float) -> None:
    """SIGTERM `proc`'s process group, SIGKILL what is left after `grace_s` (daemons it started are in it)."""
    _signal_group(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    _signal_group(proc.pid, signal.SIGKILL)
    proc.wait()


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass
