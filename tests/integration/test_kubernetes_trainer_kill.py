"""Kubernetes end to end: a trainer that dies without a goodbye (SIGKILL, as the OOM killer, a node loss or a
pre-emption past its grace period end it) is recovered by the operator, wherever in the step it dies.

The operator reconciles a tiny MilesJob on a real API server; its pods run as podman pods
(tests/integration/services/podman_node.py plays the kubelet, the Job and garbage controllers and cluster DNS).
While the job trains, the trainer's process is SIGKILLed three times, each at another point of a step, seen
from the engines (their `/server_info`, asked with the job's key): while they generate, while the trainer
trains (the engines idle after generating, not paused) and while it pushes (the engines paused for the push).
Each time the operator replaces the trainer Job (condition Restarting, reason TrainerFailed, counted once in
`status.trainerRestarts`), the new trainer resumes from the newest committed checkpoint and pushes to the same
engines, which the dead trainer may have left paused and in its weight-update group; the run reaches its
configured steps, each step after a resume trained once. `status.lastCheckpoint` is read mid-run and names a
committed checkpoint.
"""

from __future__ import annotations

import base64
import json
import os
import secrets
import signal
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml
from services.podman_node import PodmanNode, container_logs, podman, volume_path
from test_kubernetes_pods import (  # noqa: F401 - module fixtures: the image, a control plane and kubectl
    api,
    control_plane,
    image,
    kubectl,
    metrics_lines,
    tiny_job,
)

from launcher.kube import KubeApi
from launcher.spec import API_VERSION

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.container_image,
              pytest.mark.filterwarnings("ignore::urllib3.exceptions.InsecureRequestWarning")]

NS = "default"
JOB = "tiny-k8s"
CLAIM = f"{JOB}-data"
# Enough steps for every kill point on an idle machine too (a step of the tiny run takes ~0.25 s there).
STEPS = 40
# The order of the kills; `MILES_LITE_KILL_POINTS` (comma-separated) repeats or reorders them for measurements.
KILL_POINTS = tuple(os.environ.get("MILES_LITE_KILL_POINTS", "pushing,generating,training").split(","))
# Steps each trainer attempt completes before it may be killed (so that it checkpointed: interval 2).
STEPS_BEFORE_KILL = 2
RUN_TIMEOUT_S = 900.0


class Engines:
    """The job's engine pods asked for their state (`/server_info`) with the job's key, as the trainer asks."""

    def __init__(self, kube: KubeApi) -> None:
        secret = kube.get("v1", "Secret", NS, f"{JOB}-api-key")
        assert secret is not None
        self.key = base64.b64decode(secret["data"]["api-key"]).decode()
        self.api = kube
        self.ips: list[str] = []

    def refresh(self) -> None:
        pods = self.api.list("v1", "Pod", NS, {"mileslite.dev/job": JOB, "mileslite.dev/role": "rollout"})
        self.ips = [p["status"]["podIP"] for p in pods if (p.get("status") or {}).get("podIP")]

    def states(self) -> list[dict[str, Any]]:
        """Per engine: paused, requests running or waiting (an engine that does not answer is left out)."""
        out = []
        for ip in self.ips:
            req = urllib.request.Request(f"http://{ip}:30000/server_info",
                                         headers={"Authorization": f"Bearer {self.key}"})
            try:
                with urllib.request.urlopen(req, timeout=2) as resp:
                    state = json.loads(resp.read())["internal_states"][0]
            except (OSError, ValueError, KeyError):
                continue
            out.append({"paused": state["paused"], "busy": state["num_reqs"] + state["num_waiting_reqs"]})
        return out


def wait_for_point(engines: Engines, point: str, deadline: float) -> list[dict[str, Any]]:
    """Poll the engines until the step is at `point`; returns the states seen there."""
    generated = False
    while time.monotonic() < deadline:
        states = engines.states()
        if len(states) < 2:
            engines.refresh()
            continue
        paused = any(s["paused"] for s in states)
        busy = any(s["busy"] for s in states)
        if point == "pushing" and paused:
            return states
        if point == "generating" and busy and not paused:
            return states
        if point == "training":
            # Generation of this step finished and the push has not begun: the trainer trains (or checkpoints).
            generated = generated or (busy and not paused)
            if generated and not busy and not paused:
                return states
        time.sleep(0.02)  # the poll period: the engines answer on the 2 cores the run uses
    raise AssertionError(f"the engines never showed the trainer {point}")


def latest_checkpoint(volume: Path) -> int | None:
    """Step of the checkpoint `latest` names on the job's volume (the newest committed one)."""
    path = volume / "checkpoints" / "latest"
    return int(path.read_text().strip().split("_")[1]) if path.is_file() else None


def trainer_pid(node: PodmanNode, pod: str) -> int:
    """Host pid of the trainer pod's process (`exec miles-lite train`: the container's first process)."""
    return int(podman("inspect", node.container(pod), "--format", "{{.State.Pid}}").strip())


@pytest.mark.timeout(3000)
def test_sigkilled_trainer_recovers_at_every_point_of_a_step(tmp_path: Path, image: str, kubectl,  # noqa: F811
                                                           api: KubeApi, control_plane):  # noqa: F811
    kubectl("apply", "-k", "k8s/")
    kubectl("wait", "--for", "condition=established", "--timeout=60s", "crd/milesjobs.mileslite.dev")
    deployment = json.loads(kubectl("-n", "miles-lite-system", "get", "deployment", "miles-lite-operator",
                                    "-o", "json"))
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    for volume in (CLAIM, f"{JOB}-config"):
        podman("volume", "rm", "-f", volume, check=False)
    node = PodmanNode(api, NS, f"miles-k8s-{secrets.token_hex(3)}", tmp_path / "pods")
    node.start()
    operator_name = f"miles-operator-{secrets.token_hex(3)}"
    kills: list[dict[str, Any]] = []
    reasons: set[str] = set()
    last_checkpoint: str | None = None
    try:
        command = list(container["command"])
        command[command.index("--interval") + 1] = "1"
        command = command[:command.index("--liveness")]
        podman("run", "-d", "--name", operator_name, "--network", "host", "-v",
               f"{control_plane.kubeconfig}:/kube/config:ro", "-e", "KUBECONFIG=/kube/config", image, *command,
               "-n", NS, "--job-image", image)
        body = tiny_job()
        body["spec"]["overrides"] = [o for o in body["spec"]["overrides"] if not o.startswith("experiment.steps=")]
        body["spec"]["overrides"].append(f"experiment.steps={STEPS}")
        body["spec"]["faultTolerance"] = {"maxEngineRestarts": 0, "maxTrainerRestarts": len(KILL_POINTS)}
        job_file = tmp_path / "job.yaml"
        job_file.write_text(yaml.safe_dump(body))
        kubectl("apply", "-f", str(job_file))

        engines: Engines | None = None
        volume: Path | None = None
        deadline = time.monotonic() + RUN_TIMEOUT_S
        phase = None
        attempt_start = 0  # metrics records before the current trainer attempt
        while time.monotonic() < deadline:
            node.sync()
            status = (api.get(API_VERSION, "MilesJob", NS, JOB) or {}).get("status") or {}
            phase = status.get("phase")
            restarting = next((c for c in status.get("conditions") or [] if c["type"] == "Restarting"), None)
            if restarting and restarting["status"] == "True":
                reasons.add(restarting["reason"])
            if status.get("lastCheckpoint") is not None and last_checkpoint is None:
                last_checkpoint = status["lastCheckpoint"]
                assert volume is not None
                # The status names a committed checkpoint of the run (the trainer's gauge, set at its commit); at a
                # step a second, retention may have removed it for newer ones by the time this reads the volume.
                named = volume / "checkpoints" / f"step_{int(last_checkpoint):08d}"
                newest = latest_checkpoint(volume)
                assert (named / "manifest.json").is_file() or (newest is not None and newest > int(last_checkpoint)), (
                    last_checkpoint, newest)
            if phase in ("Succeeded", "Failed"):
                break
            volume = volume or volume_path(CLAIM)
            lines = metrics_lines(volume) if volume is not None else []
            trainer = next((n for n, p in node.played.items() if n.startswith(f"{JOB}-trainer-0-")
                            and p.phase == "Running"), None)
            # Each attempt is killed once it has trained a few steps and the run has a committed checkpoint that
            # the status names.
            if (len(kills) < len(KILL_POINTS) and trainer is not None and last_checkpoint is not None
                    and len(lines) - attempt_start >= STEPS_BEFORE_KILL and latest_checkpoint(volume) is not None):
                engines = engines or Engines(api)
                engines.refresh()
                point = KILL_POINTS[len(kills)]
                pid = trainer_pid(node, trainer)
                seen = wait_for_point(engines, point, deadline)
                os.kill(pid, signal.SIGKILL)
                killed_at = time.time()
                assert volume is not None
                kills.append({"point": point, "pod": trainer, "seen": seen, "time": killed_at,
                              "steps": len(metrics_lines(volume)), "checkpoint": latest_checkpoint(volume),
                              "after": engines.states()})
                attempt_start = len(metrics_lines(volume))
            time.sleep(0.5)
        logs = {n: node.logs(n) for n in node.played if n.startswith(f"{JOB}-trainer-0-")}
        assert phase == "Succeeded", (f"phase {phase}; kills {kills}\nevents: {node.events}\n"
                                      f"trainer logs:\n{''.join(v[-5000:] for v in logs.values())}\n"
                                      f"removed pods' logs:\n{node.removed_logs(6000)}\n"
                                      f"operator log:\n{container_logs(operator_name)[-3000:]}")
    finally:
        podman("rm", "-f", operator_name, check=False)
        node.close()
    print("kills:", json.dumps([{k: v for k, v in kill.items() if k != "time"} for kill in kills]))

    status = api.get(API_VERSION, "MilesJob", NS, JOB)["status"]
    assert [k["point"] for k in kills] == list(KILL_POINTS)
    # Each kill was one trainer failure, counted once; no engine was replaced.
    assert status["trainerRestarts"] == len(KILL_POINTS) and status["engineRestarts"] == 0, status
    assert reasons == {"TrainerFailed"}, reasons
    assert last_checkpoint is not None
    # A kill while pushing caught the engines paused by the push the trainer did not finish.
    for kill in kills:
        if kill["point"] == "pushing":
            assert any(s["paused"] for s in kill["seen"]), kill
    assert volume is not None
    records = [m for m in metrics_lines(volume) if "eval_phase" not in m]
    # Every attempt after a kill resumed from the newest checkpoint committed before it and trained each following
    # step once, in order, up to the configured steps.
    cuts = [k["time"] for k in kills] + [float("inf")]
    attempts = [[m["step"] for m in records if (cuts[i - 1] if i else 0) < m["time"] <= cuts[i]]
                for i in range(len(cuts))]
    # Steps count from 1; checkpoint step_N holds the run after step N, so the next attempt begins at N + 1.
    assert attempts[0] == list(range(1, len(attempts[0]) + 1)), attempts
    for kill, before, steps in zip(kills, attempts[:-1], attempts[1:], strict=True):
        assert kill["checkpoint"] is not None and steps, (kills, attempts)
        # The resume point: the checkpoint committed last, read just after the kill, or the one of the step the
        # kill cut short (a save in flight may finish its commit after the kill), never one ahead of it.
        resumed = steps[0] - 1
        assert kill["checkpoint"] <= resumed <= before[-1] + 1, (kills, attempts)
        assert steps == list(range(resumed + 1, resumed + 1 + len(steps))), (kills, attempts)
    assert attempts[-1][-1] == STEPS, attempts
    for m in records:
        assert m["sync/probe_logp_diff_max"] < 1e-3, m
