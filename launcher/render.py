"""Pure renderer: a MilesJob object -> the Kubernetes objects that run it.

`render(body)` returns, in apply order:
  ConfigMap `<job>-config`          the resolved Hydra overrides (read by every container) and the spec
  NetworkPolicy `<job>`             ingress only from the job's own pods (metrics: also the operator and
                                    spec.metrics.allowFrom); see launcher/security.py
(The Secret `<job>-api-key` holding the job's API key is created by the operator, not rendered: its key
is random, and this renderer is pure. Every pod mounts it.)
  Service   `<job>-trainer`         headless; DNS for trainer pods (Ray head, metrics)
  Service   `<job>-rollout`         headless; DNS `<job>-rollout-<i>.<job>-rollout.<ns>.svc` per engine
  PodGroup  `<job>-trainer|rollout` only for gang.scheduler volcano / coscheduling (one gang per role)
  Job       `<job>-trainer`         indexed, `replicas` pods, backoffLimit 0: any trainer failure fails the
                                    Job and the operator restarts it from the newest checkpoint
  Pod       `<job>-rollout-<i>`     one per engine, restartPolicy Never: an engine that dies is replaced
                                    by the operator (counted against maxEngineRestarts), never the trainer
Every object carries the job's labels, an ownerReference to the MilesJob (deleting it deletes them) and
a `mileslite.dev/spec-hash` annotation, so the operator can tell whether a live object is current.
No I/O, no clock: the same input gives the same output.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Mapping
from typing import Any

from launcher import commands, security
from launcher.gang import pod_group, role_gang
from launcher.spec import API_VERSION, GROUP, KIND, JobSpec, Placement, parse_job

HASH_ANNOTATION = f"{GROUP}/spec-hash"
# On pods that read the ConfigMap's overrides: changed overrides change the pod, so it is replaced.
CONFIG_HASH_ANNOTATION = f"{GROUP}/config-hash"
JOB_LABEL = f"{GROUP}/job"
ROLE_LABEL = f"{GROUP}/role"
ENGINE_INDEX_LABEL = f"{GROUP}/engine-index"
MANAGED_BY = "miles-lite-operator"
GPU_RESOURCE = "nvidia.com/gpu"


def labels(job: JobSpec, role: str | None = None) -> dict[str, str]:
    """Labels of every object of `job`; `role` (trainer | rollout) narrows them to one role's objects."""
    out = {
        "app.kubernetes.io/name": "miles-lite",
        "app.kubernetes.io/instance": job.name,
        "app.kubernetes.io/managed-by": MANAGED_BY,
        JOB_LABEL: job.name,
    }
    if role:
        out["app.kubernetes.io/component"] = role
        out[ROLE_LABEL] = role
    return out


def selector(job: JobSpec, role: str) -> dict[str, str]:
    """The label selector of one role's pods."""
    return {JOB_LABEL: job.name, ROLE_LABEL: role}


def owner_reference(job: JobSpec) -> dict[str, Any]:
    """ownerReference to the MilesJob: garbage collection deletes the children with it."""
    return {"apiVersion": API_VERSION, "kind": KIND, "name": job.name, "uid": job.uid,
            "controller": True, "blockOwnerDeletion": True}


def _metadata(job: JobSpec, name: str, role: str | None) -> dict[str, Any]:
    return {"name": name, "namespace": job.namespace, "labels": labels(job, role),
            "ownerReferences": [owner_reference(job)]}


def spec_hash(obj: Mapping[str, Any]) -> str:
    """Stable digest of a rendered object, excluding its own hash annotation (16 hex characters)."""
    clean = copy.deepcopy(dict(obj))
    clean.get("metadata", {}).get("annotations", {}).pop(HASH_ANNOTATION, None)
    return hashlib.sha256(json.dumps(clean, sort_keys=True).encode()).hexdigest()[:16]


def _stamp(obj: dict[str, Any]) -> dict[str, Any]:
    obj["metadata"].setdefault("annotations", {})[HASH_ANNOTATION] = spec_hash(obj)
    return obj


def _resources(placement: Placement, gpus: int) -> dict[str, Any]:
    requests = {k: v for k, v in placement.requests.items()}
    limits = {k: v for k, v in placement.limits.items()}
    if gpus:
        # Extended resources: request must equal limit; the spec's GPU count is authoritative.
        limits[GPU_RESOURCE] = gpus
        requests[GPU_RESOURCE] = gpus
    out: dict[str, Any] = {}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def _volumes(job: JobSpec, role: str, gpus: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    volumes: list[dict[str, Any]] = [{"name": "config", "configMap": {"name": f"{job.name}-config"}}]
    mounts: list[dict[str, Any]] = [{"name": "config", "mountPath": commands.CONFIG_MOUNT, "readOnly": True}]
    if job.model.pvc_claim:
        volumes.append({"name": "model",
                        "persistentVolumeClaim": {"claimName": job.model.pvc_claim, "readOnly": True}})
        mount: dict[str, Any] = {"name": "model", "mountPath": job.model.pvc_mount_path, "readOnly": True}
        if job.model.pvc_sub_path:
            mount["subPath"] = job.model.pvc_sub_path
        mounts.append(mount)
    if role == "trainer" or commands.shares_volume(job):
        if job.checkpoint.claim_name:
            volumes.append({"name": "checkpoints",
                            "persistentVolumeClaim": {"claimName": job.checkpoint.claim_name}})
        else:
            volumes.append({"name": "checkpoints", "emptyDir": {}})
        mounts.append({"name": "checkpoints", "mountPath": job.checkpoint.mount_path})
    else:
        # An engine without the job's volume still finds the run's output directory (the overrides put it on the
        # checkpoint mount; the reference engine caches the job's tokenizer there): scratch space, the root
        # filesystem being read-only.
        volumes.append({"name": "outputs-scratch", "emptyDir": {}})
        mounts.append({"name": "outputs-scratch", "mountPath": job.checkpoint.mount_path})
    # The job's key (the operator's Secret), and scratch space on the read-only root filesystem.
    volumes.append(security.key_volume(job))
    mounts.append(security.key_mount())
    scratch, scratch_mounts = security.scratch_volumes()
    volumes += scratch
    mounts += scratch_mounts
    if gpus:
        # NCCL and SGLang need more shared memory than the container runtime's 64 MiB default.
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory"}})
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    return volumes, mounts


def _env(job: JobSpec, role: str) -> list[dict[str, Any]]:
    def field_ref(path: str) -> dict[str, Any]:
        return {"valueFrom": {"fieldRef": {"fieldPath": path}}}

    return [
        {"name": "MILES_LITE_JOB", "value": job.name},
        {"name": "MILES_LITE_ROLE", "value": role},
        {"name": "MILES_LITE_TRAINER_HOST", "value": commands.trainer_head_host(job)},
        {"name": "MILES_LITE_TRAINER_REPLICAS", "value": str(job.trainer.replicas)},
        {"name": "POD_NAME", **field_ref("metadata.name")},
        {"name": "POD_NAMESPACE", **field_ref("metadata.namespace")},
        security.key_env(),
        # Caches of a user without a home directory (the pods run as an arbitrary uid).
        {"name": "HOME", "value": security.SCRATCH_MOUNTS["work"]},
        *copy.deepcopy(job.env),
    ]


def _pod_spec(job: JobSpec, role: str, command: list[str], ports: list[dict[str, Any]],
              placement: Placement, gpus: int, subdomain: str, scheduler: str | None) -> dict[str, Any]:
    volumes, mounts = _volumes(job, role, gpus)
    container: dict[str, Any] = {
        "name": role,
        "image": job.image,
        "imagePullPolicy": job.image_pull_policy,
        "command": command,
        "env": _env(job, role),
        "ports": ports,
        "volumeMounts": mounts,
        "securityContext": security.container_security_context(),
    }
    resources = _resources(placement, gpus)
    if resources:
        container["resources"] = resources
    if role == "rollout":
        container["readinessProbe"] = {
            "httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 5, "failureThreshold": 3,
        }
    spec: dict[str, Any] = {
        "subdomain": subdomain,
        "restartPolicy": "Never",
        "enableServiceLinks": False,
        "containers": [container],
        "volumes": volumes,
        "securityContext": security.pod_security_context(),
        # The job's processes call no Kubernetes API: no token in the pods, unless the job names an account.
        "automountServiceAccountToken": bool(job.service_account),
    }
    if placement.node_selector:
        spec["nodeSelector"] = dict(placement.node_selector)
    if placement.tolerations:
        spec["tolerations"] = copy.deepcopy(placement.tolerations)
    if job.service_account:
        spec["serviceAccountName"] = job.service_account
    if scheduler:
        spec["schedulerName"] = scheduler
    return spec


def scrape_annotations(job: JobSpec) -> dict[str, str]:
    """Prometheus' conventional pod annotations: scrape the trainer's exporter on the metrics port."""
    return {"prometheus.io/scrape": "true", "prometheus.io/port": str(job.metrics_port),
            "prometheus.io/path": "/metrics"}


def render_config_map(job: JobSpec, body: Mapping[str, Any]) -> dict[str, Any]:
    """ConfigMap with `overrides` (one Hydra override per line) and `milesjob.json` (the spec as submitted)."""
    overrides = commands.resolved_overrides(job)
    return {
        "apiVersion": "v1", "kind": "ConfigMap", "metadata": _metadata(job, f"{job.name}-config", None),
        "data": {
            commands.OVERRIDES_FILE: "\n".join(overrides) + "\n",
            commands.ENGINES_FILE: "\n".join(commands.engine_urls(job)) + "\n",
            "milesjob.json": json.dumps(body.get("spec") or {}, sort_keys=True, indent=1),
        },
    }


def config_hash(overrides_text: str) -> str:
    """Digest of the overrides the pods start with, less the engine count and URLs: a running trainer follows
    those through the engines file, so scaling the engines restarts no pod."""
    kept = [line for line in overrides_text.splitlines()
            if line.split("=", 1)[0].lstrip("+~").strip() not in commands.SCALING_KEYS]
    return hashlib.sha256("\n".join(kept).encode()).hexdigest()[:16]


def render_services(job: JobSpec) -> list[dict[str, Any]]:
    """Headless Services of both roles; not-ready pods are published so rendezvous works before readiness."""
    trainer_ports = [{"name": "metrics", "port": job.metrics_port, "targetPort": "metrics"}]
    if job.trainer.replicas > 1:
        trainer_ports.append({"name": "ray", "port": commands.RAY_PORT, "targetPort": "ray"})
    out = []
    for role, name, ports in (
        ("trainer", commands.trainer_name(job), trainer_ports),
        ("rollout", commands.rollout_name(job), [{"name": "http", "port": job.rollout.port, "targetPort": "http"}]),
    ):
        out.append({
            "apiVersion": "v1", "kind": "Service", "metadata": _metadata(job, name, role),
            "spec": {"clusterIP": "None", "publishNotReadyAddresses": True, "selector": selector(job, role),
                     "ports": ports},
        })
    return out


def render_pod_groups(job: JobSpec) -> list[dict[str, Any]]:
    """One PodGroup per role for volcano / coscheduling; empty for kueue and none."""
    out = []
    for role, members, gpus in (("trainer", job.trainer.replicas, job.trainer.gpus_per_replica),
                                ("rollout", job.rollout.engines, job.rollout.gpus_per_engine)):
        name = f"{job.name}-{role}"
        pg = pod_group(job, name, members, gpus, _metadata(job, name, role))
        if pg is not None:
            out.append(pg)
    return out


def render_trainer_job(job: JobSpec, config_hash: str = "") -> dict[str, Any]:
    """The indexed trainer Job: `replicas` pods named `<job>-trainer-<index>` on subdomain `<job>-trainer`.

    `config_hash`: spec hash of the job's ConfigMap, recorded on the pod template.
    """
    name = commands.trainer_name(job)
    gang = role_gang(job, name, job.trainer.replicas, owned_by_job=True)
    ports = [{"name": "metrics", "containerPort": job.metrics_port}]
    if job.trainer.replicas > 1:
        ports.append({"name": "ray", "containerPort": commands.RAY_PORT})
    pod_spec = _pod_spec(job, "trainer", commands.trainer_command(job), ports, job.trainer.placement,
                         job.trainer.gpus_per_replica, name, gang.scheduler_name)
    meta = _metadata(job, name, "trainer")
    meta["labels"].update(gang.workload_labels)
    return {
        "apiVersion": "batch/v1", "kind": "Job", "metadata": meta,
        "spec": {
            "completionMode": "Indexed",
            "completions": job.trainer.replicas,
            "parallelism": job.trainer.replicas,
            # The operator, not the Job controller, decides on restarts (and resumes from a checkpoint).
            "backoffLimit": 0,
            "template": {
                "metadata": {"labels": {**labels(job, "trainer"), **gang.pod_labels},
                             "annotations": {**gang.pod_annotations, **scrape_annotations(job),
                                             CONFIG_HASH_ANNOTATION: config_hash}},
                "spec": pod_spec,
            },
        },
    }


def render_engine_pod(job: JobSpec, index: int, config_hash: str = "") -> dict[str, Any]:
    """Rollout engine pod `index` (0-based), hostname `<job>-rollout-<index>` on subdomain `<job>-rollout`.

    `config_hash`: spec hash of the ConfigMap; recorded only for the reference engine, which reads it.
    """
    if not 0 <= index < job.rollout.engines:
        raise ValueError(f"engine index {index} outside [0, {job.rollout.engines}) of spec.rollout.engines")
    name = commands.engine_pod_name(job, index)
    group = commands.rollout_name(job)
    gang = role_gang(job, group, job.rollout.engines, owned_by_job=False)
    pod_spec = _pod_spec(job, "rollout", commands.engine_command(job),
                         [{"name": "http", "containerPort": job.rollout.port}], job.rollout.placement,
                         job.rollout.gpus_per_engine if job.rollout.backend == "sglang" else 0, group,
                         gang.scheduler_name)
    pod_spec["hostname"] = name
    meta = _metadata(job, name, "rollout")
    meta["labels"].update({**gang.pod_labels, ENGINE_INDEX_LABEL: str(index)})
    annotations = dict(gang.pod_annotations)
    if job.rollout.backend == "reference":
        annotations[CONFIG_HASH_ANNOTATION] = config_hash
    if annotations:
        meta["annotations"] = annotations
    return _stamp({"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": pod_spec})


def render_network_policy(job: JobSpec) -> dict[str, Any]:
    """The job's NetworkPolicy (see `launcher.security`)."""
    return security.render_network_policy(job, _metadata(job, job.name, None), {JOB_LABEL: job.name})


def key_secret_metadata(job: JobSpec) -> dict[str, Any]:
    """Metadata of the job's key Secret (its data is the operator's: `security.ensure_key_secret`)."""
    return _metadata(job, security.secret_name(job), None)


def render_job(job: JobSpec, body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """All objects of a parsed job, in apply order (see the module docstring)."""
    config_map = _stamp(render_config_map(job, body))
    # Only the overrides reach the processes; the recorded spec copy must not restart pods.
    digest = config_hash(config_map["data"][commands.OVERRIDES_FILE])
    objs = [render_network_policy(job), *render_services(job), *render_pod_groups(job),
            render_trainer_job(job, digest)]
    return [config_map, *(_stamp(o) for o in objs),
            *(render_engine_pod(job, i, digest) for i in range(job.rollout.engines))]


def render(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A MilesJob object (metadata + spec) -> its Kubernetes objects; raises SpecError naming bad fields."""
    return render_job(parse_job(body), body)
