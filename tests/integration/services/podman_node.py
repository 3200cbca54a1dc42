"""A one-node Kubernetes stand-in for tests: runs the API server's Pods with `podman kube play`.

The test control plane (kube_apiserver.py) has no scheduler, controller manager or kubelet. `PodmanNode`
plays the parts a MilesJob needs, each pass of `sync()` reading the API server and acting on it:

- Job controller: for an indexed Job with parallelism > 0 it creates pod `<job>-<index>-<suffix>` from the
  template (hostname `<job>-<index>`, the completion-index annotation and JOB_COMPLETION_INDEX), and sets
  the Job's Complete / Failed condition when pod 0 exits. Garbage collector: a pod whose Job is gone is
  deleted (a Job recreated under the same name starts with pods of its own).
- kubelet: every Pod object is played with podman on one network (its ConfigMap volumes read back from
  the API server and played with it); a pod's status (phase, podIP, Ready from its HTTP readiness probe)
  is written back; a pod deleted in the API server is removed from podman. (Pods are never bound to a
  node here, so the API server deletes them at once; there is no garbage collector either.)
- cluster DNS: a pod with `hostname` and `subdomain` naming a headless Service that selects it answers
  to `<hostname>.<subdomain>.<namespace>.svc` (a network alias on aardvark-dns).
Pod specs are played as rendered, except what podman 4.3 cannot take and a kubelet resolves itself:
downward-API fieldRefs become their values, probes are run by this class rather than by podman, and
container ports are not published on the host (podman 4.3 would; pods are reached at their addresses).
Volumes are prepared as a kubelet does for a pod with an `fsGroup`: a Secret volume is a directory of its
keys (files root:fsGroup with the volume's defaultMode, behind the `..data` link layout), an emptyDir a
fresh world-writable directory, and a claim's volume group-owned by fsGroup and group-writable.
"""

from __future__ import annotations

import base64
import copy
import json
import os
import secrets
import subprocess
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from launcher.kube import KubeApi

REPO = Path(__file__).resolve().parents[3]
# podman on hosts without systemd (CI VMs): cgroupfs, runc, no default ulimits.
NOSYSTEMD_CONF = REPO / "images" / "podman-nosystemd.conf"
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"


def podman_env() -> dict[str, str]:
    """Environment for podman calls: images/podman-nosystemd.conf where PID 1 is not systemd."""
    env = dict(os.environ)
    if "CONTAINERS_CONF" not in env and Path("/proc/1/comm").read_text().strip() != "systemd":
        env["CONTAINERS_CONF"] = str(NOSYSTEMD_CONF)
    return env


def podman(*args: str, check: bool = True, timeout: float = 120.0, stdin: str | None = None) -> str:
    """Run one podman command; its stdout (raises with stderr when `check` and it fails)."""
    done = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout, env=podman_env(),
                          input=stdin)
    if check and done.returncode != 0:
        raise RuntimeError(f"podman {' '.join(args)} failed ({done.returncode}): {done.stderr[-2000:]}")
    return done.stdout


def container_logs(container: str) -> str:
    """A container's stdout and stderr, interleaved as written."""
    done = subprocess.run(["podman", "logs", container], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=120, env=podman_env())
    return done.stdout


def volume_path(name: str) -> Path | None:
    """Host directory of podman volume `name` (what a PVC claim of that name is played as), or None."""
    out = podman("volume", "inspect", name, "--format", "{{.Mountpoint}}", check=False).strip()
    return Path(out) if out else None


def _owner_uid(pod: dict[str, Any]) -> str | None:
    """uid of the Job that controls `pod`, or None (a pod no Job owns)."""
    return next((r["uid"] for r in pod["metadata"].get("ownerReferences") or []
                 if r.get("kind") == "Job" and r.get("controller")), None)


@dataclass
class _Played:
    uid: str
    containers: list[str]
    ip: str | None = None
    phase: str = "Pending"


@dataclass
class PodmanNode:
    """Runs the Pods of `namespace` on podman network `network`; call `sync()` repeatedly, `close()` at the end."""

    api: KubeApi
    namespace: str
    network: str
    workdir: Path
    played: dict[str, _Played] = field(default_factory=dict)
    events: list[str] = field(default_factory=list)
    # podman keeps a played ConfigMap as a named volume; removed on close.
    config_volumes: set[str] = field(default_factory=set)

    def start(self) -> None:
        """Create the network (with DNS) this node's pods share."""
        podman("network", "create", self.network)
        self.workdir.mkdir(parents=True, exist_ok=True)

    def close(self) -> None:
        """Remove every pod this node played, then the network."""
        for name in list(self.played):
            self._remove(name)
        for volume in self.config_volumes:
            podman("volume", "rm", "-f", volume, check=False)
        podman("network", "rm", "-f", self.network, check=False)

    # ---- one pass ----
    def sync(self) -> None:
        """One pass of the Job controller, the kubelet and the status writer."""
        self._jobs()
        pods = {p["metadata"]["name"]: p for p in self.api.list("v1", "Pod", self.namespace, {})}
        for name in list(self.played):
            pod = pods.get(name)
            if pod is None or pod["metadata"]["uid"] != self.played[name].uid or pod["metadata"].get(
                    "deletionTimestamp"):
                self._remove(name)
        for name, pod in pods.items():
            if pod["metadata"].get("deletionTimestamp"):
                continue
            if name not in self.played:
                self._play(pod)
            else:
                self._report(pod)

    def logs(self, pod: str) -> str:
        """The logs (stdout and stderr) of every container of a played pod, or of one removed before."""
        played = self.played.get(pod)
        if played is None:
            return "".join(p.read_text() for p in sorted(self.workdir.glob(f"{pod}.*.log")))
        return "".join(container_logs(c) for c in played.containers)

    def removed_logs(self, tail: int = 3000) -> str:
        """The last `tail` characters of each removed pod's logs, headed by its name and uid."""
        return "".join(f"--- {p.stem} ---\n{p.read_text()[-tail:]}\n" for p in sorted(self.workdir.glob("*.log")))

    def container(self, pod: str) -> str:
        """podman's name of the (single) container of `pod`."""
        return self.played[pod].containers[0]

    # ---- Job controller ----
    def _jobs(self) -> None:
        jobs = self.api.list("batch/v1", "Job", self.namespace, {})
        self._collect_garbage({j["metadata"]["uid"] for j in jobs})
        for job in jobs:
            meta, spec = job["metadata"], job["spec"]
            status = job.get("status") or {}
            if meta.get("deletionTimestamp") or any(
                    c.get("status") == "True" for c in status.get("conditions") or []):
                continue
            labels = {"job-name": meta["name"]}
            # A Job recreated under the same name owns none of its predecessor's pods.
            pods = [p for p in self.api.list("v1", "Pod", self.namespace, labels)
                    if _owner_uid(p) == meta["uid"]]
            if int(spec.get("parallelism", 1)) > 0 and not pods:
                self._create_job_pod(job, 0)
                continue
            pod0 = next((p for p in pods if (p["metadata"].get("annotations") or {}).get(COMPLETION_INDEX) == "0"),
                        None)
            phase = (pod0 or {}).get("status", {}).get("phase")
            if phase == "Succeeded":
                self.api.patch("batch/v1", "Job", self.namespace, meta["name"], {"status": {
                    "active": 0, "succeeded": 1, "completedIndexes": "0",
                    "conditions": [{"type": "Complete", "status": "True"}]}}, "status")
            elif phase == "Failed":
                self.api.patch("batch/v1", "Job", self.namespace, meta["name"], {"status": {
                    "active": 0, "failed": 1,
                    "conditions": [{"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded"}]}},
                    "status")
            elif phase == "Running" and int(status.get("active") or 0) != 1:
                self.api.patch("batch/v1", "Job", self.namespace, meta["name"], {"status": {"active": 1}}, "status")

    def _collect_garbage(self, job_uids: set[str]) -> None:
        """The garbage collector's part: pods whose owning Job is gone are deleted (background propagation)."""
        for pod in self.api.list("v1", "Pod", self.namespace, {}):
            owner = _owner_uid(pod)
            if owner is not None and owner not in job_uids and not pod["metadata"].get("deletionTimestamp"):
                self.api.delete("v1", "Pod", self.namespace, pod["metadata"]["name"])
                self.events.append(f"garbage-collected pod {pod['metadata']['name']}")

    def _create_job_pod(self, job: dict[str, Any], index: int) -> None:
        meta = job["metadata"]
        template = copy.deepcopy(job["spec"]["template"])
        tmeta = template.setdefault("metadata", {})
        tmeta["name"] = f"{meta['name']}-{index}-{secrets.token_hex(3)}"
        tmeta["namespace"] = self.namespace
        tmeta.setdefault("labels", {})["job-name"] = meta["name"]
        tmeta.setdefault("annotations", {})[COMPLETION_INDEX] = str(index)
        tmeta["ownerReferences"] = [{"apiVersion": "batch/v1", "kind": "Job", "name": meta["name"],
                                     "uid": meta["uid"], "controller": True}]
        spec = template["spec"]
        spec["hostname"] = f"{meta['name']}-{index}"
        for c in spec["containers"]:
            c.setdefault("env", []).append({"name": "JOB_COMPLETION_INDEX", "value": str(index)})
        self.api.create({"apiVersion": "v1", "kind": "Pod", **template})
        self.events.append(f"job {meta['name']}: created pod {tmeta['name']}")

    # ---- kubelet ----
    def _aliases(self, pod: dict[str, Any]) -> list[str]:
        """Cluster DNS names of `pod`: `<hostname>.<subdomain>.<ns>.svc` when a headless Service selects it."""
        spec, labels = pod["spec"], pod["metadata"].get("labels") or {}
        host, sub = spec.get("hostname"), spec.get("subdomain")
        if not host or not sub:
            return []
        svc = self.api.get("v1", "Service", self.namespace, sub)
        if svc is None or svc["spec"].get("clusterIP") != "None":
            return []
        if any(labels.get(k) != v for k, v in (svc["spec"].get("selector") or {}).items()):
            return []
        fqdn = f"{host}.{sub}.{self.namespace}.svc"
        return [fqdn, f"{fqdn}.cluster.local"]

    def _manifest(self, pod: dict[str, Any]) -> str:
        """The pod (and the ConfigMaps it mounts) as podman can play them."""
        meta = pod["metadata"]
        spec = copy.deepcopy(pod["spec"])
        for c in spec["containers"]:
            c.pop("readinessProbe", None)
            c.pop("livenessProbe", None)
            # Pods are reached at their own addresses; podman 4.3 would publish containerPorts on the host.
            c.pop("ports", None)
            for env in c.get("env") or []:
                ref = (env.get("valueFrom") or {}).get("fieldRef")
                if ref:
                    value = {"metadata.name": meta["name"], "metadata.namespace": self.namespace}[ref["fieldPath"]]
                    env.pop("valueFrom")
                    env["value"] = value
        docs: list[dict[str, Any]] = []
        fs_group = int((spec.get("securityContext") or {}).get("fsGroup") or 0)
        for vol in spec.get("volumes") or []:
            if "secret" in vol:
                vol["hostPath"] = {"path": str(self._secret_dir(meta["name"], vol, fs_group)), "type": "Directory"}
                vol.pop("secret")
            elif "emptyDir" in vol:
                path = self.workdir / "emptydir" / meta["name"] / vol["name"]
                path.mkdir(parents=True, exist_ok=True)
                path.chmod(0o1777)
                vol["hostPath"] = {"path": str(path), "type": "Directory"}
                vol.pop("emptyDir")
            elif "persistentVolumeClaim" in vol and fs_group:
                self._own_claim(vol["persistentVolumeClaim"]["claimName"], fs_group)
            if "configMap" in vol:
                cm = self.api.get("v1", "ConfigMap", self.namespace, vol["configMap"]["name"])
                if cm is None:
                    raise RuntimeError(f"pod {meta['name']} mounts absent ConfigMap {vol['configMap']['name']}")
                self.config_volumes.add(cm["metadata"]["name"])
                docs.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": cm["metadata"]["name"]},
                             "data": cm.get("data") or {}})
        docs.append({"apiVersion": "v1", "kind": "Pod",
                     "metadata": {"name": meta["name"], "labels": meta.get("labels") or {},
                                  "annotations": meta.get("annotations") or {}},
                     "spec": spec})
        return yaml.safe_dump_all(docs, sort_keys=False)

    def _secret_dir(self, pod: str, vol: dict[str, Any], fs_group: int) -> Path:
        """The Secret's keys as a kubelet lays them out: `<key>` -> `..data/<key>`, root:fsGroup, defaultMode."""
        name = vol["secret"]["secretName"]
        secret = self.api.get("v1", "Secret", self.namespace, name)
        if secret is None:
            raise RuntimeError(f"pod {pod} mounts absent Secret {name}")
        root = self.workdir / "secrets" / pod / vol["name"]
        data = root / "..data"
        data.mkdir(parents=True, exist_ok=True)
        for key, value in (secret.get("data") or {}).items():
            path = data / key
            path.write_bytes(base64.b64decode(value))
            os.chown(path, 0, fs_group)
            path.chmod(int(vol["secret"].get("defaultMode", 0o644)))
            link = root / key
            if not link.is_symlink():
                link.symlink_to(f"..data/{key}")
        return root

    def _own_claim(self, claim: str, fs_group: int) -> None:
        """The claim's volume (created if absent) group-owned by `fs_group`, group-writable, setgid."""
        if volume_path(claim) is None:
            podman("volume", "create", claim)
        path = volume_path(claim)
        assert path is not None
        for directory, _, files in os.walk(path):
            for entry in [directory, *(os.path.join(directory, f) for f in files)]:
                os.chown(entry, -1, fs_group)
                os.chmod(entry, os.stat(entry).st_mode | 0o060 | (0o2010 if entry == directory else 0))

    def _play(self, pod: dict[str, Any]) -> None:
        name = pod["metadata"]["name"]
        path = self.workdir / f"{name}.yaml"
        path.write_text(self._manifest(pod))
        aliases = self._aliases(pod)
        net = f"{self.network}:" + ",".join(f"alias={a}" for a in aliases) if aliases else self.network
        podman("kube", "play", "--network", net, str(path), timeout=300)
        containers = [f"{name}-{c['name']}" for c in pod["spec"]["containers"]]
        self.played[name] = _Played(pod["metadata"]["uid"], containers)
        self.events.append(f"played pod {name}")
        self._report(pod)

    def _remove(self, name: str) -> None:
        # Keep what the pod wrote (a kubelet keeps a dead container's logs until the pod is gone).
        played = self.played[name]
        (self.workdir / f"{name}.{played.uid}.log").write_text(self.logs(name))
        podman("pod", "rm", "-f", "-t", "5", name, check=False)
        self.played.pop(name, None)
        self.events.append(f"removed pod {name}")

    def _state(self, container: str) -> tuple[str, int]:
        out = podman("inspect", container, "--format", "{{.State.Status}} {{.State.ExitCode}}", check=False).split()
        return (out[0], int(out[1])) if len(out) == 2 else ("missing", -1)

    def _ip(self, name: str) -> str | None:
        out = podman("pod", "inspect", name, "--format", "{{.InfraContainerID}}", check=False).strip()
        if not out:
            return None
        nets = json.loads(podman("inspect", out, "--format", "{{json .NetworkSettings.Networks}}", check=False)
                          or "{}")
        return (nets.get(self.network) or {}).get("IPAddress") or None

    def _ready(self, pod: dict[str, Any], ip: str) -> bool:
        c = pod["spec"]["containers"][0]
        probe = (c.get("readinessProbe") or {}).get("httpGet")
        if probe is None:
            return True
        port = probe["port"]
        if isinstance(port, str):
            port = next(p["containerPort"] for p in c.get("ports") or [] if p.get("name") == port)
        try:
            with urllib.request.urlopen(f"http://{ip}:{port}{probe.get('path', '/')}", timeout=2) as resp:
                return resp.status == 200
        except OSError:
            return False

    def _report(self, pod: dict[str, Any]) -> None:
        name = pod["metadata"]["name"]
        played = self.played[name]
        states = [self._state(c) for c in played.containers]
        if all(s == "exited" for s, _ in states):
            phase = "Succeeded" if all(code == 0 for _, code in states) else "Failed"
        elif any(s == "running" for s, _ in states) or played.phase == "Running":
            phase = "Running"  # (a container on its way out reads neither running nor exited)
        else:
            phase = "Pending"
        played.ip = played.ip or self._ip(name)
        ready = phase == "Running" and played.ip is not None and self._ready(pod, played.ip)
        status: dict[str, Any] = {"phase": phase, "conditions": [
            {"type": "Ready", "status": "True" if ready else "False"}]}
        if played.ip:
            status["podIP"] = played.ip
        current = pod.get("status") or {}
        if current.get("phase") != phase or current.get("podIP") != status.get("podIP") or \
                {c["type"]: c["status"] for c in current.get("conditions") or []}.get("Ready") != \
                status["conditions"][0]["status"]:
            if phase != played.phase:
                self.events.append(f"pod {name}: {phase}")
            played.phase = phase
            self.api.patch("v1", "Pod", self.namespace, name, {"status": status}, "status")
