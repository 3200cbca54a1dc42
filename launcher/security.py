"""What keeps a MilesJob's pods to themselves: its API key Secret, its NetworkPolicy, its security contexts.

- Secret `<job>-api-key`: the key every engine endpoint and the weight-update group ask for. The operator
  creates it once per job with a fresh random key (`ensure_key_secret`; owner reference to the MilesJob, so it
  goes with the job) and never rewrites it (it cannot even read it: its role may only create Secrets), so
  restarted pods keep the key of the engines they talk to. Every
  pod mounts it read-only at `KEY_DIR` and finds it through `MILES_API_KEY_FILE`; the key is in no
  environment variable, no command line and not in the MilesJob.
- NetworkPolicy `<job>`: trainer and engine pods admit connections only from pods of the same job, plus the
  metrics port from the operator (it reads the trainer's progress there) and from the peers listed in
  `spec.metrics.allowFrom` (a Prometheus namespace or pod selector). It takes effect where the cluster's
  network plugin enforces NetworkPolicies.
- Security contexts: non-root user and group, `fsGroup` for the volumes, the runtime's default seccomp
  profile, no privilege escalation, every capability dropped, and a read-only root filesystem; what a run
  writes goes to its volumes (outputs, checkpoints) and to two emptyDirs, `/tmp` and the working directory.
"""

from __future__ import annotations

import base64
from typing import Any

from launcher.kube import Conflict, KubeApi
from launcher.spec import JobSpec
from miles_lite.net.api_key import ENV_KEY_FILE, KEY_FILE_NAME, new_key

KEY_DIR = "/var/run/miles-lite/api-key"
# The uid/gid pods run as (the images run as any user: /work and /tmp are theirs through emptyDirs).
RUN_AS = 1000
SCRATCH_MOUNTS = {"tmp": "/tmp", "work": "/work"}
# The operator's pods (k8s/deployment.yaml): namespace and labels.
OPERATOR_NAMESPACE = "miles-lite-system"
OPERATOR_LABELS = {"app.kubernetes.io/name": "miles-lite-operator"}


def secret_name(job: JobSpec) -> str:
    return f"{job.name}-api-key"


def render_key_secret(job: JobSpec, metadata: dict[str, Any], key: str) -> dict[str, Any]:
    """The job's key Secret holding `key` (metadata: the job's, with its owner reference)."""
    return {"apiVersion": "v1", "kind": "Secret", "metadata": metadata, "type": "Opaque",
            "data": {KEY_FILE_NAME: base64.b64encode(key.encode()).decode()}}


def ensure_key_secret(api: KubeApi, job: JobSpec, metadata: dict[str, Any]) -> str:
    """Create the job's key Secret with a fresh key unless it exists; returns created | unchanged.

    Create-only (409: it exists, and its key stays): the operator's role may create Secrets but read none."""
    try:
        api.create(render_key_secret(job, metadata, new_key()))
    except Conflict:
        return "unchanged"
    return "created"


def key_volume(job: JobSpec) -> dict[str, Any]:
    """The Secret as a volume: the owner reads it, the pod's fsGroup too (mode 0440), nobody else."""
    return {"name": "api-key", "secret": {"secretName": secret_name(job), "defaultMode": 0o440}}


def key_mount() -> dict[str, Any]:
    return {"name": "api-key", "mountPath": KEY_DIR, "readOnly": True}


def key_env() -> dict[str, Any]:
    return {"name": ENV_KEY_FILE, "value": f"{KEY_DIR}/{KEY_FILE_NAME}"}


def scratch_volumes() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """emptyDirs for what a process writes outside its volumes, on a read-only root filesystem."""
    volumes = [{"name": name, "emptyDir": {}} for name in SCRATCH_MOUNTS]
    mounts = [{"name": name, "mountPath": path} for name, path in SCRATCH_MOUNTS.items()]
    return volumes, mounts


def pod_security_context() -> dict[str, Any]:
    return {"runAsNonRoot": True, "runAsUser": RUN_AS, "runAsGroup": RUN_AS, "fsGroup": RUN_AS,
            "seccompProfile": {"type": "RuntimeDefault"}}


def container_security_context() -> dict[str, Any]:
    return {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}}


def render_network_policy(job: JobSpec, metadata: dict[str, Any], job_selector: dict[str, str]) -> dict[str, Any]:
    """Ingress of the job's pods: from the job's own pods; the metrics port also from the operator and
    `spec.metrics.allowFrom`."""
    operator = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": OPERATOR_NAMESPACE}},
                "podSelector": {"matchLabels": dict(OPERATOR_LABELS)}}
    metrics_peers = [operator, *(dict(peer) for peer in job.metrics_allow_from)]
    return {
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": metadata,
        "spec": {
            "podSelector": {"matchLabels": dict(job_selector)},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [{"podSelector": {"matchLabels": dict(job_selector)}}]},
                {"from": metrics_peers, "ports": [{"protocol": "TCP", "port": job.metrics_port}]},
            ],
        },
    }
