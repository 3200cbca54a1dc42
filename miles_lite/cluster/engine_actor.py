"""One rollout engine as a Ray actor: it starts the engine server on its own node and reports where.

`EngineServer` is the body of the actor that `cluster.engine_gang` places in one bundle of the
rollout gang. `start()` launches the server (SGLang or the reference engine) as a child process of
the actor, bound to the node's address, waits until it generates and returns an `EngineLocation`
(`http://<node address>:<port>`, the server's pid, the Ray node and, under Slurm, the node's name).
The fleet then talks HTTP to that URL; liveness, fault injection and shutdown go through the actor,
which owns the process.

Lifecycle of the actor: created -> started (`start`) -> stopped (`stop`); a server that exits on its
own is reported by `returncode()` and the actor is then stopped and killed by the gang.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
from collections.abc import Mapping
from dataclasses import dataclass

from miles_lite.config.schema import RolloutConfig
from miles_lite.net.ports import node_address


@dataclass(frozen=True)
class EngineLocation:
    """Where one engine server runs: its URL and process, its Ray node and host."""

    engine_id: str
    slot: int
    incarnation: int
    url: str
    pid: int
    node_id: str
    node_address: str
    hostname: str
    # SLURMD_NODENAME of the Ray node the actor runs on ("" outside Slurm).
    slurm_node: str
    # MILES_RAY_ROLE of that Ray node: the role it was started for (slurm/lib/ray_node.sh sets it; "" if unset).
    node_role: str

    def describe(self) -> str:
        where = self.node_address + (f" (Slurm node {self.slurm_node})" if self.slurm_node else "")
        where += f", a {self.node_role} node" if self.node_role else ""
        return (f"engine {self.engine_id} slot {self.slot} incarnation {self.incarnation}: Ray node "
                f"{self.node_id[:12]} at {where}, host {self.hostname}, pid {self.pid}, serving {self.url}")


def on_ray_gpus(rollout: RolloutConfig) -> RolloutConfig:
    """`rollout` for an engine inside a Ray bundle: Ray shows it only its own GPUs, so SGLang starts at GPU 0."""
    args = dict(rollout.sglang_args)
    args.setdefault("base_gpu_id", 0)
    return dataclasses.replace(rollout, sglang_args=args)


class EngineServer:
    """Body of one engine's Ray actor (see the module docstring)."""

    def __init__(self, rollout: RolloutConfig, model_path: str, log_dir: str, slot: int, incarnation: int,
                 env: Mapping[str, str] | None = None, own_gpus: bool = True, api_key: str | None = None) -> None:
        """`own_gpus`: the actor holds its engine's GPUs (Ray shows it only those); False when colocated,
        where the engine shares the node's GPUs with the trainer and `sglang_args.base_gpu_id` applies.
        `api_key`: the run's key, written to a private file on this node for the server (removed at `stop`)."""
        from miles_lite.engines.launcher import EngineLauncher
        from miles_lite.net.api_key import ApiKey

        self.key = ApiKey.private(api_key) if api_key is not None else None

        self.slot = slot
        self.incarnation = incarnation
        # The Ray node's own address: the server binds it and the fleet dials it.
        self.address = node_address()
        self.launcher = EngineLauncher(on_ray_gpus(rollout) if own_gpus else rollout, model_path, log_dir,
                                       host=self.address, env=env, api_key=self.key)
        self.process = self.launcher.create(slot, attempt=incarnation)
        self.startup_timeout_s = rollout.startup_timeout_s

    def start(self) -> EngineLocation:
        """Start the server and wait until it generates; raises `EngineStartError` with its log tail."""
        import ray

        self.process.start()
        try:
            self.process.wait_ready(self.startup_timeout_s)
        except BaseException:
            self.process.stop()
            raise
        return EngineLocation(
            engine_id=self.launcher.engine_id(self.slot), slot=self.slot, incarnation=self.incarnation,
            url=self.process.url, pid=int(self.process.pid or 0),
            node_id=ray.get_runtime_context().get_node_id(), node_address=self.address,
            hostname=socket.gethostname(), slurm_node=os.environ.get("SLURMD_NODENAME", ""),
            node_role=os.environ.get("MILES_RAY_ROLE", ""),
        )

    def returncode(self) -> int | None:
        """The server's exit code, None while it runs."""
        return self.process.returncode

    def kill_server(self, signum: int = signal.SIGKILL) -> int | None:
        """Send `signum` to the server process alone (fault injection); its pid, None if it had none."""
        pid = self.process.pid
        if pid is not None and self.process.returncode is None:
            os.kill(pid, signum)
        return pid

    def log_tail(self, lines: int = 40) -> str:
        return self.process.log_tail(lines)

    def stacks(self, title: str) -> tuple[str, str]:
        """What the server's processes on this node are doing (`engines.process_stacks`), written beside its log
        here: the file's name and the report, for the driver's logs."""
        import asyncio

        from miles_lite.engines.process_stacks import stacks_path, stacks_report
        from miles_lite.formats.files import write_atomic

        path = stacks_path(self.process.log_path)
        pid = self.process.pid
        report = f"{title}\nthe server never started\n" if pid is None else asyncio.run(stacks_report(pid, title))
        write_atomic(path, report)
        return path.name, report

    def stop(self, grace_s: float = 10.0) -> int | None:
        """SIGTERM the server's process group, SIGKILL after `grace_s`; its exit code."""
        try:
            return self.process.stop(grace_s)
        finally:
            if self.key is not None:
                self.key.close()
