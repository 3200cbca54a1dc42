"""The rollout gang on a real two-node Ray cluster on one machine.

The head node (the driver's) carries the trainer's resource; a second node, started with its own
node IP (127.0.0.2), carries the rollout resource. A short `miles-lite train` must place every engine
on the rollout node (its Ray node id, and the URL the fleet dials), push verified weights from the
trainer's node to the engines' (the engines dial the trainer rank 0 node's address), replace an
engine SIGKILLed mid-run on the rollout node and admit it again. A rollout gang larger than the
rollout node fails at start, naming the role and what is missing.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from ray_cluster import LocalRayCluster

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]

ROLLOUT_IP = "127.0.0.2"
ENGINES = 2


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalRayCluster, dict[str, Any]]]:
    pytest.importorskip("ray")
    ray_cluster = LocalRayCluster(tmp_path_factory.mktemp("ray"))
    try:
        ray_cluster.add_node("127.0.0.1", "trainer", cpus=1, resources={"miles_trainer": 1}, head=True)
        ray_cluster.add_node(ROLLOUT_IP, "rollout", cpus=ENGINES, resources={"miles_rollout": ENGINES})
        yield ray_cluster, _nodes(ray_cluster.address)
    finally:
        ray_cluster.stop()


def _nodes(address: str) -> dict[str, Any]:
    """Node id -> [address, resources] of the cluster's alive nodes (this process connects briefly)."""
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(address=address, log_to_driver=False)
    try:
        return {n["NodeID"]: [n["NodeManagerAddress"], n["Resources"]] for n in ray.nodes() if n["Alive"]}
    finally:
        ray.shutdown()


def _overrides(address: str, tmp_path: Path, *extra: str) -> list[str]:
    return [
        "cluster=ray", f"cluster.ray_address={address}", "cluster.trainer_gpus_per_rank=0", "cluster.engine_gpus=0",
        "cluster.trainer_resource=miles_trainer", "cluster.rollout_resource=miles_rollout",
        "cluster.placement_timeout_s=20", f"experiment.output_dir={tmp_path}", "experiment.run_name=run",
        "experiment.warmup=none", "data.presample.enabled=false", "rollout.prompts_per_step=2",
        "rollout.group_size=2", "rollout.max_new_tokens=8", "data.synthetic.eval_size=2", "experiment.eval_size=2",
        "observability.progress=false", f"rollout.engines={ENGINES}", *extra,
    ]


def _records(run: Path) -> list[dict[str, Any]]:
    path = run / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def _placements(run: Path) -> list[dict[str, Any]]:
    path = run / "logs/engines.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def _wait(condition: Any, timeout_s: float, what: str, proc: subprocess.Popen[str], log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if proc.poll() is not None:
            raise AssertionError(f"the run exited ({proc.returncode}) before {what}:\n{log.read_text()[-4000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}:\n{log.read_text()[-4000:]}")
        time.sleep(0.5)  # poll interval of the condition above


def test_engines_run_on_the_rollout_node_and_a_killed_one_is_replaced_there(cluster, tmp_path: Path) -> None:
    ray_cluster, nodes = cluster
    rollout_node = next(nid for nid, (_, res) in nodes.items() if "miles_rollout" in res)
    trainer_node, (trainer_ip, _) = next((nid, v) for nid, v in nodes.items() if "miles_trainer" in v[1])
    assert nodes[rollout_node][0] == ROLLOUT_IP and trainer_ip != ROLLOUT_IP
    # Many more steps than needed: the run is stopped with SIGTERM once the replacement serves again.
    cmd = [sys.executable, "-m", "miles_lite.cli", "train", *_overrides(
        ray_cluster.address, tmp_path, "experiment.steps=500", "fault_tolerance.health_interval_s=0.5",
        "fault_tolerance.failure_threshold=2", "fault_tolerance.max_engine_restarts=2",
        "fault_tolerance.request_retries=4", "rollout.request_timeout_s=60")]
    log_path = tmp_path / "driver.log"
    run = tmp_path / "run"
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, "RAY_AUTH_MODE": "disabled"})
        try:
            _wait(lambda: len(_records(run)) >= 1, 600, "the first RL step", proc, log_path)
            first = _placements(run)
            assert len(first) == ENGINES, first
            victim = first[0]
            os.kill(victim["pid"], signal.SIGKILL)

            def readmitted() -> bool:
                last = (_records(run) or [{}])[-1]
                return last.get("fleet/restarts", 0) >= 1 and last.get("fleet/engines_healthy") == ENGINES

            _wait(readmitted, 300, "a step with the replacement admitted", proc, log_path)
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=300) == 0, log_path.read_text()[-4000:]
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
                # Engine servers run in their own sessions: a driver killed here cannot stop them.
                for p in _placements(run):
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(p["pid"], signal.SIGKILL)
    driver_log = log_path.read_text()

    placements = _placements(run)
    table = "\n".join(f"{p['engine_id']} slot {p['slot']} inc {p['incarnation']}: node {p['node_id'][:12]} "
                      f"{p['node_address']} {p['url']} pid {p['pid']}" for p in placements)
    print(f"engine-to-node table (trainer node {trainer_node[:12]} at {trainer_ip}):\n{table}")
    # Every engine, the replacement included, ran on the rollout node and was dialed at its address.
    assert sorted((p["slot"], p["incarnation"]) for p in placements) == sorted([(0, 0), (1, 0), (victim["slot"], 1)])
    for p in placements:
        assert p["node_id"] == rollout_node and p["node_address"] == ROLLOUT_IP and p["node_role"] == "rollout", p
        assert urlsplit(p["url"]).hostname == ROLLOUT_IP, p
    assert placements[-1]["pid"] != victim["pid"]
    assert "rollout gang: engine" in driver_log
    # What the dead engine's processes were doing, looked at on its node by its actor before the fleet stopped it.
    stacks = (run / "logs" / f"{victim['engine_id']}.0.stacks.txt").read_text()
    assert stacks.startswith(f"engine {victim['engine_id']} (slot {victim['slot']}, start 0) on {ROLLOUT_IP} "
                             "declared dead: "), stacks
    assert f"process group of pid {victim['pid']}" in stacks, stacks
    # The engines joined the weight-update group at the trainer rank 0 node's address.
    engine_logs = "".join(f.read_text(errors="replace") for f in (run / "logs").glob("reference-*.log"))
    joined = re.findall(r"weight-update group \S+ at ([^\s:]+):\d+", engine_logs)
    assert joined and set(joined) == {trainer_ip}, joined
    # Every push was verified (the probe scored the same on both sides), every step ran once.
    records = _records(run)
    summary = json.loads((run / "summary.json").read_text())
    assert [r["step"] for r in records] == list(range(1, summary["steps_done"] + 1))
    assert all(r["sync/probe_logp_diff_mean"] < 1e-3 for r in records)
    assert records[-1]["fleet/restarts"] >= 1 and records[-1]["fleet/engines_healthy"] == ENGINES


def test_an_unplaceable_rollout_gang_fails_at_start_naming_what_is_missing(cluster, tmp_path: Path) -> None:
    ray_cluster, _ = cluster
    cmd = [sys.executable, "-m", "miles_lite.cli", "train",
           *_overrides(ray_cluster.address, tmp_path, "experiment.steps=1", "cluster.placement_timeout_s=3"),
           f"rollout.engines={ENGINES + 1}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert "the rollout gang (3 bundles) asks" in out and "miles_rollout 3" in out, out[-3000:]
    assert "miles_rollout 2 in total" in out, out[-3000:]
    assert not _placements(tmp_path / "run"), "no engine starts when its gang cannot be placed"


def _raylet(ip: str) -> int:
    """Pid of the raylet of the Ray node at `ip`."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            args = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if args and args[0].endswith(b"/raylet") and f"--node_ip_address={ip}".encode() in args:
            return int(proc.name)
    raise AssertionError(f"no raylet of the Ray node at {ip}")


# Last in the module: it loses the cluster's rollout node.
def test_a_lost_rollout_node_is_named_with_the_step_and_the_checkpoint(cluster, tmp_path: Path) -> None:
    ray_cluster, nodes = cluster
    rollout_node = next(nid for nid, (_, res) in nodes.items() if "miles_rollout" in res)
    cmd = [sys.executable, "-m", "miles_lite.cli", "train", *_overrides(
        ray_cluster.address, tmp_path, "experiment.steps=500", "checkpoint.interval=1",
        "fault_tolerance.health_interval_s=0.5", "fault_tolerance.failure_threshold=2",
        "fault_tolerance.max_engine_restarts=1", "rollout.startup_timeout_s=60", "rollout.request_timeout_s=30",
        # A replacement of the lost node's engines waits this long for room in the gang before it counts as failed.
        "cluster.placement_timeout_s=5")]
    log_path = tmp_path / "driver.log"
    run = tmp_path / "run"
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, "RAY_AUTH_MODE": "disabled"})
        try:
            _wait(lambda: len(_records(run)) >= 2, 600, "two RL steps", proc, log_path)
            os.kill(_raylet(ROLLOUT_IP), signal.SIGKILL)
            code = proc.wait(timeout=600)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            for p in _placements(run):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p["pid"], signal.SIGKILL)
    out = log_path.read_text()
    (last,) = [line for line in out.splitlines() if line.startswith("miles-lite train: ")]
    summary = json.loads((run / "summary.json").read_text())
    loss = summary["node_loss"]
    resume = Path(loss["resume_from"])
    # One line: the node (address, role, id), the step it was lost at and the checkpoint a rerun resumes from.
    assert code == 5, out[-4000:]
    assert last.startswith(f"miles-lite train: Ray node {ROLLOUT_IP} (rollout, node id {rollout_node[:12]}) was "
                           f"lost at step {loss['step']}/500 ("), last
    assert last.endswith(f"the run resumes from {resume} (run the same command again)"), last
    assert resume.parent == run / "checkpoints" and (resume / "manifest.json").is_file()
    # The step lost is the one after those done; its own checkpoint is the resume point when the node went
    # during the step's push, after its save (a save in flight is let commit).
    assert loss["step"] == summary["steps_done"] + 1
    assert int(resume.name.split("_")[1]) in (loss["step"] - 1, loss["step"])
    assert loss["nodes"] == [{"node_id": rollout_node, "address": ROLLOUT_IP, "role": "rollout"}]
    assert "Traceback" in (run / "logs/run.log").read_text()
