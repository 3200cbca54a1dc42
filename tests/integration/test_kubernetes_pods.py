"""Kubernetes end to end: the operator, in the CPU image, reconciles a tiny MilesJob on a real API server;
the Pods, Services and ConfigMaps it created there run as podman pods on one network (tests/integration/
services/podman_node.py plays the kubelet, the Job controller and cluster DNS). The job trains with weight
pushes from the trainer container to two engine containers over the distributed transport (the trainer's
Service address), checkpoints to the job's volume, and goes on when an engine container is killed: the
operator replaces the pod and the trainer's fleet re-admits the new engine after a push. Then the trainer
container gets SIGTERM (the graceful stop): it checkpoints, exits 0, and the job is Succeeded.

`kubectl` is Debian's kubernetes-client (scripts/install-services.sh unpacks it): it applies `k8s/` exactly as
docs/kubernetes.md says, has the server validate `k8s/examples/tiny-cpu.yaml` as the docs submit it, and
submits that example shortened (a few steps, checkpoints on a named volume). The operator runs as the
Deployment's user on a read-only root filesystem. The image is built by scripts/build-image.sh (cached by its
inputs).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client, config
from services.kube_apiserver import ControlPlane, ready_apiserver, start_control_plane
from services.podman_node import PodmanNode, container_logs, podman, volume_path

from launcher.kube import KubeApi
from launcher.spec import API_VERSION

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.container_image,
              pytest.mark.filterwarnings("ignore::urllib3.exceptions.InsecureRequestWarning")]

REPO = Path(__file__).resolve().parents[2]
NS = "default"
JOB = "tiny-k8s"
CLAIM = f"{JOB}-data"
# More steps than the test lets run: it stops the trainer once the replacement engine serves.
STEPS = 1000
KILL_AFTER_STEPS = 3
RUN_TIMEOUT_S = 900.0


def _missing(reason: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"in CI {reason}")
    pytest.skip(reason)


def kubectl_binary() -> Path | None:
    """Debian's kubectl: $MILES_LITE_KUBECTL, else the one scripts/install-services.sh unpacked."""
    explicit = os.environ.get("MILES_LITE_KUBECTL")
    cache = Path(os.environ.get("MILES_LITE_CACHE", "/var/cache/miles-lite"))
    path = Path(explicit) if explicit else cache / "kubernetes-client" / "usr" / "bin" / "kubectl"
    return path if path.is_file() and os.access(path, os.X_OK) else None


@pytest.fixture(scope="module")
def image() -> str:
    if shutil.which("podman") is None or shutil.which("mmdebstrap") is None:
        _missing("podman and mmdebstrap are not installed (scripts/install-services.sh)")
    started = time.monotonic()
    done = subprocess.run([str(REPO / "scripts" / "build-image.sh"), "cpu", "--debootstrap"], capture_output=True,
                          text=True, timeout=3600)
    assert done.returncode == 0, done.stderr[-4000:]
    print(f"image build: {time.monotonic() - started:.0f} s")
    return done.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    if ready_apiserver() is None:
        _missing("kube-apiserver is not built (scripts/build-kube-apiserver.sh)")
    cp = start_control_plane(tmp_path_factory.mktemp("kube"))
    try:
        yield cp
    finally:
        cp.stop()


@pytest.fixture(scope="module")
def kubectl(control_plane: ControlPlane):
    binary = kubectl_binary()
    if binary is None:
        _missing("Debian's kubectl is not unpacked (scripts/install-services.sh)")
    env = {**os.environ, "KUBECONFIG": str(control_plane.kubeconfig)}

    def run(*args: str, stdin: str | None = None) -> str:
        done = subprocess.run([str(binary), *args], capture_output=True, text=True, env=env, cwd=REPO, input=stdin,
                              timeout=120)
        assert done.returncode == 0, f"kubectl {' '.join(args)}: {done.stderr}"
        return done.stdout

    return run


@pytest.fixture(scope="module")
def api(control_plane: ControlPlane) -> KubeApi:
    cfg = client.Configuration()
    config.load_kube_config(config_file=str(control_plane.kubeconfig), client_configuration=cfg)
    return KubeApi(client.ApiClient(cfg))


def tiny_job() -> dict[str, Any]:
    """k8s/examples/tiny-cpu.yaml (no image: the operator's own), shortened, checkpoints on a named volume."""
    body = yaml.safe_load((REPO / "k8s" / "examples" / "tiny-cpu.yaml").read_text())
    body["metadata"] = {"name": JOB, "namespace": NS}
    spec = body["spec"]
    spec["overrides"] = [
        "experiment=tiny_cpu", "trainer=cpu", f"experiment.steps={STEPS}", "experiment.warmup=none",
        "experiment.run_name=run", "data.presample.enabled=false", "data.synthetic.eval_size=4",
        "rollout.prompts_per_step=2", "rollout.group_size=4", "rollout.max_new_tokens=32",
        "rollout.request_timeout_s=60", "fault_tolerance.health_interval_s=0.5",
        "fault_tolerance.failure_threshold=2", "observability.progress=false",
    ]
    spec["checkpoint"] = {"volume": {"claimName": CLAIM}, "interval": 2, "keepLast": 2}
    spec["faultTolerance"] = {"maxEngineRestarts": 2, "maxTrainerRestarts": 0}
    return body


def metrics_lines(volume: Path) -> list[dict[str, Any]]:
    path = volume / "outputs" / "run" / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def service_names_resolve(api: KubeApi, node: PodmanNode) -> dict[str, str]:
    """Once the job's three pods run: the DNS names the pods dial each other by (engine URLs, the trainer's
    advertise address), resolved inside the other role's container, mapped to the address they resolve to;
    asserted equal to the podIP the API server holds for the named pod. Empty while a pod is not up yet."""
    pods = {p["metadata"]["name"]: p for p in api.list("v1", "Pod", NS, {"mileslite.dev/job": JOB})}
    trainer = next((n for n in pods if n.startswith(f"{JOB}-trainer-0-")), None)
    engines = [f"{JOB}-rollout-{i}" for i in range(2)]
    if trainer is None or any(n not in pods or not (pods[n].get("status") or {}).get("podIP")
                              for n in [trainer, *engines]):
        return {}
    lookups = [(trainer, f"{JOB}-trainer-0.{JOB}-trainer.{NS}.svc", engines[0])]
    lookups += [(e, f"{e}.{JOB}-rollout.{NS}.svc", trainer) for e in engines]
    out = {}
    for pod, name, from_pod in lookups:
        address = podman("exec", node.container(from_pod), "python3", "-c",
                         f"import socket; print(socket.gethostbyname({name!r}))").strip()
        assert address == pods[pod]["status"]["podIP"], (name, address, pods[pod]["status"])
        out[name] = address
    return out


def engines_ask_for_the_key(api: KubeApi) -> dict[str, tuple[int, int]]:
    """Engine pod -> (status of /model_info without the job's key, status of /health), asked from outside the
    job (this host); the key itself is in no pod spec and no MilesJob."""
    out = {}
    for pod in api.list("v1", "Pod", NS, {"mileslite.dev/job": JOB, "mileslite.dev/role": "rollout"}):
        ip = (pod.get("status") or {}).get("podIP")
        if not ip:
            continue
        statuses = []
        for path in ("/model_info", "/health"):
            try:
                with urllib.request.urlopen(f"http://{ip}:30000{path}", timeout=10) as resp:
                    statuses.append(resp.status)
            except urllib.error.HTTPError as err:
                statuses.append(err.code)
        out[pod["metadata"]["name"]] = (statuses[0], statuses[1])
    return out


# A cold machine builds the image first (Debian base, wheelhouse, dependency layer: minutes).
@pytest.mark.timeout(3000)
def test_milesjob_trains_across_podman_pods(tmp_path: Path, image: str, kubectl, api: KubeApi,
                                           control_plane: ControlPlane):
    started = time.monotonic()
    # Install exactly as docs/kubernetes.md says: the CRD, namespace, RBAC and the operator Deployment.
    kubectl("apply", "-k", "k8s/")
    kubectl("wait", "--for", "condition=established", "--timeout=60s", "crd/milesjobs.mileslite.dev")
    deployment = json.loads(kubectl("-n", "miles-lite-system", "get", "deployment", "miles-lite-operator",
                                    "-o", "json"))
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    # The image the build tagged is the one the kustomization deploys.
    assert container["image"] == image

    # The example exactly as the docs submit it passes the server's schema validation of the CRD.
    assert "milesjob.mileslite.dev/tiny-cpu created (server dry run)" in kubectl(
        "apply", "--dry-run=server", "-f", "k8s/examples/tiny-cpu.yaml")

    # A volume left by an earlier run would hold its checkpoints, and the job would resume from them.
    for volume in (CLAIM, f"{JOB}-config"):
        podman("volume", "rm", "-f", volume, check=False)
    node = PodmanNode(api, NS, f"miles-k8s-{secrets.token_hex(3)}", tmp_path / "pods")
    node.start()
    operator_name = f"miles-operator-{secrets.token_hex(3)}"
    try:
        # The operator's own container command, in the image, against the test API server (host network:
        # the API server listens on loopback), reconciling every second, as the Deployment's user on a
        # read-only root filesystem (no tmpfs either: Kubernetes mounts none). Outside a pod it cannot read
        # its own image, so it is told (--job-image), as the Deployment's pod would find it.
        command = [a for a in container["command"]]
        command[command.index("--interval") + 1] = "1"
        command = command[:command.index("--liveness")]
        security = deployment["spec"]["template"]["spec"]["securityContext"]
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
        podman("run", "-d", "--name", operator_name, "--network", "host",
               "--user", f"{security['runAsUser']}:{security['runAsGroup']}", "--read-only",
               "--read-only-tmpfs=false", "-v", f"{control_plane.kubeconfig}:/kube/config:ro",
               "-e", "KUBECONFIG=/kube/config", image, *command, "-n", NS, "--job-image", image)
        job_file = tmp_path / "job.yaml"
        job_file.write_text(yaml.safe_dump(tiny_job()))
        kubectl("apply", "-f", str(job_file))

        resolved: dict[str, str] = {}
        keyed: dict[str, tuple[int, int]] = {}
        killed_after: int | None = None
        readmitted_at: int | None = None
        volume: Path | None = None
        deadline = time.monotonic() + RUN_TIMEOUT_S
        phase = None
        while time.monotonic() < deadline:
            node.sync()
            status = (api.get(API_VERSION, "MilesJob", NS, JOB) or {}).get("status") or {}
            phase = status.get("phase")
            if phase in ("Succeeded", "Failed"):
                break
            volume = volume or volume_path(CLAIM)
            lines = metrics_lines(volume) if volume is not None else []
            if lines and not resolved and killed_after is None:
                resolved = service_names_resolve(api, node)
                keyed = engines_ask_for_the_key(api)
            if killed_after is None and len(lines) >= KILL_AFTER_STEPS:
                killed_after = len(lines)
                podman("kill", node.container(f"{JOB}-rollout-1"))
            elif killed_after is not None and readmitted_at is None and any(
                    m["fleet/restarts"] == 1 and m["fleet/engines_healthy"] == 2 for m in lines[killed_after:]):
                readmitted_at = len(lines)
                trainer = next(n for n in node.played if n.startswith(f"{JOB}-trainer-0-"))
                podman("kill", "--signal", "TERM", node.container(trainer))
            time.sleep(0.5)
        trainer_pod = next((n for n in node.played if n.startswith(f"{JOB}-trainer-0-")), None)
        logs = node.logs(trainer_pod) if trainer_pod else "<no trainer pod>"
        # The trainer's last lines (its exception, if any) come first: CI shows the start of a long message.
        last = "\n".join(logs.splitlines()[-40:])
        assert phase == "Succeeded", (f"phase {phase}; trainer log, last 40 lines:\n{last}\nevents: {node.events}\n"
                                      f"trainer log tail:\n{logs[-6000:]}\n"
                                      f"removed pods' logs:\n{node.removed_logs()}\n"
                                      f"operator log:\n{container_logs(operator_name)[-3000:]}")
        print(f"MilesJob {JOB}: Succeeded after {time.monotonic() - started:.0f} s; events: {node.events}")
    finally:
        podman("rm", "-f", operator_name, check=False)
        node.close()

    # Each side dialled the other by its Service name, resolved to that pod's own address.
    assert len(resolved) == 3, resolved
    # The engines asked for the job's key (the operator's Secret, mounted) while the run trained with it.
    assert keyed == {f"{JOB}-rollout-{i}": (401, 200) for i in range(2)}, keyed
    secret = api.get("v1", "Secret", NS, f"{JOB}-api-key")
    assert secret is not None and secret["metadata"]["ownerReferences"][0]["name"] == JOB
    job = api.get(API_VERSION, "MilesJob", NS, JOB)
    assert job["spec"]["image"] == image  # written by the operator: the example names none
    status = job["status"]
    assert killed_after is not None and readmitted_at is not None
    # The operator replaced the killed engine pod (counted) and never restarted the trainer.
    assert status["engineRestarts"] == 1 and status["trainerRestarts"] == 0, status
    assert volume is not None
    lines = metrics_lines(volume)
    assert [m["step"] for m in lines] == list(range(1, len(lines) + 1)), [m["step"] for m in lines]
    # Every step's push crossed containers and was verified on the engines (probe logprobs).
    for m in lines:
        assert m["sync/probe_logp_diff_max"] < 1e-3, m
    healthy = [m["fleet/engines_healthy"] for m in lines]
    restarts = [m["fleet/restarts"] for m in lines]
    # Two engines; the fleet declared the killed one dead and re-admitted the engine of its new pod (a step
    # may never see it missing: the pod can be back before a health check fails, and is then caught by
    # the weight version its new process reports); two again at the end.
    assert healthy[0] == 2 and restarts[0] == 0 and restarts[-1] == 1 and healthy[-1] == 2, (healthy, restarts)
    # Checkpoints landed on the job's volume; the graceful stop wrote the last one.
    ckpts = sorted(p.name for p in (volume / "checkpoints").iterdir() if p.name.startswith("step_"))
    assert ckpts and ckpts[-1] == f"step_{len(lines):08d}", (ckpts, len(lines))
    assert (volume / "checkpoints" / ckpts[-1] / "manifest.json").is_file()
    # `kubectl get milesjobs` shows the job as docs/kubernetes.md does.
    header, row = kubectl("get", "milesjobs").splitlines()
    assert header.split() == ["NAME", "PHASE", "ENGINES", "STEP", "ENGINE-RESTARTS", "AGE"], header
    assert row.split()[:5] == [JOB, "Succeeded", status["engines"], str(status["step"]), "1"], row
