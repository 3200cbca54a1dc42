"""The MilesJob custom resource as a typed, validated value.

`parse_job` reads a MilesJob object (as the API server stores it, or as a user wrote it before
the server applied the CRD's defaults) into frozen dataclasses. The defaults here equal the
`default:` values of k8s/crd.yaml (a unit test keeps them equal), so rendering a job gives the same
objects whether or not the API server defaulted it. Rules that a JSON schema cannot state (a
SGLang engine needs a model and a GPU, names short enough for pod hostnames) live here too.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from launcher import kube_fields

GROUP = "mileslite.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "MilesJob"
PLURAL = "milesjobs"

# Longest derived name is "<job>-trainer-<index>" (a pod hostname, 63 characters at most).
MAX_NAME_LEN = 45
GANG_SCHEDULERS = ("volcano", "coscheduling", "kueue", "none")
BACKENDS = ("sglang", "reference")
_DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


class SpecError(ValueError):
    """A MilesJob that cannot be rendered; `problems` holds one line per offending field."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("invalid MilesJob:\n  - " + "\n  - ".join(problems))


def uses_gpus(spec: Mapping[str, Any]) -> bool:
    """Whether a MilesJob spec (as submitted) needs the GPU image: SGLang engines or GPU trainer pods."""
    rollout, trainer = spec.get("rollout") or {}, spec.get("trainer") or {}
    return rollout.get("backend", "sglang") == "sglang" or int(trainer.get("gpusPerReplica") or 0) > 0


def gpu_variant(image: str) -> str:
    """The GPU image beside a CPU image: NAME:TAG -> NAME:TAG-gpu (scripts/build-image.sh tags both)."""
    name, sep, tag = image.rpartition(":")
    if "@" in image or not sep or "/" in tag:
        raise ValueError(f"image {image!r} has no tag to derive the GPU image from; give spec.image")
    return f"{name}:{tag}-gpu"


@dataclass(frozen=True)
class Placement:
    """Where a role's pods may run and what each container asks for."""

    requests: dict[str, Any] = field(default_factory=dict)
    limits: dict[str, Any] = field(default_factory=dict)
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: list[dict[str, Any]] = field(default_factory=list)


@dataclass(frozen=True)
class ModelSpec:
    """Weights: an HF directory inside the container, optionally on a mounted PVC."""

    hf_path: str | None = None
    pvc_claim: str | None = None
    pvc_mount_path: str = "/models"
    pvc_sub_path: str | None = None


@dataclass(frozen=True)
class TrainerSpec:
    """Trainer pods: `replicas` nodes of `gpus_per_replica` GPUs; pod 0 runs the driver."""

    replicas: int = 1
    gpus_per_replica: int = 0
    placement: Placement = field(default_factory=Placement)


@dataclass(frozen=True)
class RolloutSpec:
    """Rollout engines: one pod of `gpus_per_engine` GPUs each, serving SGLang's HTTP API on `port`."""

    backend: str = "sglang"
    engines: int = 1
    gpus_per_engine: int = 1
    port: int = 30000
    sglang_args: dict[str, Any] = field(default_factory=dict)
    placement: Placement = field(default_factory=Placement)


@dataclass(frozen=True)
class GangSpec:
    """Gang scheduling of each role: which scheduler, its queue, and the start-up deadline (seconds)."""

    scheduler: str = "none"
    timeout_seconds: int = 600
    queue: str | None = None
    scheduler_name: str | None = None


@dataclass(frozen=True)
class CheckpointSpec:
    """Checkpoint volume (a PVC claim, or None for an emptyDir) and cadence in optimizer steps."""

    claim_name: str | None = None
    mount_path: str = "/checkpoints"
    interval: int = 50
    keep_last: int = 2


@dataclass(frozen=True)
class FaultToleranceSpec:
    """Replacement budgets: engine pods replaced and trainer restarts (from the newest checkpoint)."""

    max_engine_restarts: int = 3
    max_trainer_restarts: int = 3


@dataclass(frozen=True)
class JobSpec:
    """One MilesJob: its identity (name, namespace, uid, generation) and its validated spec."""

    name: str
    namespace: str
    uid: str
    generation: int
    image: str
    image_pull_policy: str = "IfNotPresent"
    service_account: str | None = None
    overrides: list[str] = field(default_factory=list)
    env: list[dict[str, Any]] = field(default_factory=list)
    model: ModelSpec = field(default_factory=ModelSpec)
    trainer: TrainerSpec = field(default_factory=TrainerSpec)
    rollout: RolloutSpec = field(default_factory=RolloutSpec)
    gang: GangSpec = field(default_factory=GangSpec)
    checkpoint: CheckpointSpec = field(default_factory=CheckpointSpec)
    fault_tolerance: FaultToleranceSpec = field(default_factory=FaultToleranceSpec)
    metrics_port: int = 9400
    # NetworkPolicyPeer objects (namespaceSelector / podSelector / ipBlock) that may scrape the metrics port.
    metrics_allow_from: list[dict[str, Any]] = field(default_factory=list)


# Environment variables the operator sets from the job's key Secret; the MilesJob must not carry a key.
RESERVED_ENV = ("MILES_API_KEY", "MILES_API_KEY_FILE")
PEER_KEYS = ("namespaceSelector", "podSelector", "ipBlock")


class _Reader:
    """Typed field access that records every problem instead of stopping at the first."""

    def __init__(self, problems: list[str]):
        self.problems = problems

    def section(self, parent: Mapping[str, Any], key: str, path: str) -> Mapping[str, Any]:
        value = parent.get(key)
        if value is None:
            return {}
        if not isinstance(value, Mapping):
            self.problems.append(f"{path}.{key}: expected an object, got {type(value).__name__}")
            return {}
        return value

    def integer(self, parent: Mapping[str, Any], key: str, path: str, default: int, lo: int, hi: int) -> int:
        value = parent.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int):
            self.problems.append(f"{path}.{key}: expected an integer, got {value!r}")
            return default
        if not lo <= value <= hi:
            self.problems.append(f"{path}.{key}: {value} is outside [{lo}, {hi}]")
            return default
        return value

    def string(self, parent: Mapping[str, Any], key: str, path: str, default: str | None,
               choices: tuple[str, ...] | None = None) -> str | None:
        value = parent.get(key, default)
        if value is None:
            return None
        if not isinstance(value, str) or not value:
            self.problems.append(f"{path}.{key}: expected a non-empty string, got {value!r}")
            return default
        if choices and value not in choices:
            self.problems.append(f"{path}.{key}: {value!r} is not one of {list(choices)}")
            return default
        return value

    def mapping(self, parent: Mapping[str, Any], key: str, path: str) -> dict[str, Any]:
        return dict(self.section(parent, key, path))

    def listing(self, parent: Mapping[str, Any], key: str, path: str) -> list[Any]:
        value = parent.get(key) or []
        if not isinstance(value, list):
            self.problems.append(f"{path}.{key}: expected a list, got {type(value).__name__}")
            return []
        return list(value)

    def quantities(self, parent: Mapping[str, Any], key: str, path: str) -> dict[str, Any]:
        """A requests/limits map: resource names to quantities, as the API server would accept them."""
        out = self.mapping(parent, key, path)
        for name, value in out.items():
            where = f"{path}.{key}[{name!r}]"
            problem = kube_fields.qualified_name(str(name))
            if problem:
                self.problems.append(f"{where}: the resource name {problem}")
            problem = kube_fields.quantity(value)
            if problem:
                self.problems.append(f"{where}: {value!r} {problem}")
        return out

    def placement(self, role: Mapping[str, Any], path: str) -> Placement:
        resources = self.section(role, "resources", path)
        selector = {str(k): str(v) for k, v in self.mapping(role, "nodeSelector", path).items()}
        for k, v in selector.items():
            problem = kube_fields.qualified_name(k)
            if problem:
                self.problems.append(f"{path}.nodeSelector[{k!r}]: the label key {problem}")
            problem = kube_fields.label_value(v)
            if problem:
                self.problems.append(f"{path}.nodeSelector[{k!r}]: the label value {v!r} {problem}")
        tolerations = self.listing(role, "tolerations", path)
        for i, t in enumerate(tolerations):
            key = t.get("key") if isinstance(t, Mapping) else None
            if key and kube_fields.qualified_name(str(key)):
                self.problems.append(f"{path}.tolerations[{i}].key: {key!r} {kube_fields.qualified_name(str(key))}")
        return Placement(
            requests=self.quantities(resources, "requests", f"{path}.resources"),
            limits=self.quantities(resources, "limits", f"{path}.resources"),
            node_selector=selector,
            tolerations=tolerations,
        )

    def object_name(self, value: str | None, path: str) -> None:
        """A referenced object's name (PVC, service account): a DNS subdomain."""
        if value is not None and not _DNS_SUBDOMAIN.match(value):
            self.problems.append(f"{path}: {value!r} must be a DNS subdomain (lower-case a-z, 0-9, '-', '.') "
                                 "naming an existing object")


def parse_job(body: Mapping[str, Any]) -> JobSpec:
    """Read and validate a MilesJob object (dict with metadata and spec); raise SpecError listing every problem."""
    problems: list[str] = []
    r = _Reader(problems)
    meta = body.get("metadata") or {}
    name = str(meta.get("name") or "")
    if not _DNS_LABEL.match(name) or len(name) > MAX_NAME_LEN:
        problems.append(
            f"metadata.name: {name!r} must be a DNS label (a-z, 0-9, '-') of at most {MAX_NAME_LEN} "
            "characters, because pod hostnames append '-trainer-<index>' to it"
        )
    spec = r.section(body, "spec", "")
    image = r.string(spec, "image", "spec", None)
    if image is None:
        problems.append("spec.image: required; set it to an image holding miles-lite (and SGLang for GPU jobs), "
                        "or run the operator with a default (--job-image, or its own image in a pod)")
    elif kube_fields.image_reference(image):
        problems.append(f"spec.image: {image!r} {kube_fields.image_reference(image)}")
    overrides = [str(o) for o in r.listing(spec, "overrides", "spec")]
    for i, o in enumerate(overrides):
        if not o or o[0].isspace() or "\n" in o:
            problems.append(f"spec.overrides[{i}]: {o!r} must be one Hydra override (key=value) on one line")

    m = r.section(spec, "model", "spec")
    pvc = r.section(m, "pvc", "spec.model")
    model = ModelSpec(
        hf_path=r.string(m, "hfPath", "spec.model", None),
        pvc_claim=r.string(pvc, "claimName", "spec.model.pvc", None),
        pvc_mount_path=r.string(pvc, "mountPath", "spec.model.pvc", "/models") or "/models",
        pvc_sub_path=r.string(pvc, "subPath", "spec.model.pvc", None),
    )
    r.object_name(model.pvc_claim, "spec.model.pvc.claimName")
    if pvc and model.pvc_claim is None:
        problems.append("spec.model.pvc.claimName: required when spec.model.pvc is set")

    t = r.section(spec, "trainer", "spec")
    trainer = TrainerSpec(
        replicas=r.integer(t, "replicas", "spec.trainer", 1, 1, 1024),
        gpus_per_replica=r.integer(t, "gpusPerReplica", "spec.trainer", 0, 0, 16),
        placement=r.placement(t, "spec.trainer"),
    )
    ro = r.section(spec, "rollout", "spec")
    rollout = RolloutSpec(
        backend=r.string(ro, "backend", "spec.rollout", "sglang", BACKENDS) or "sglang",
        engines=r.integer(ro, "engines", "spec.rollout", 1, 1, 1024),
        gpus_per_engine=r.integer(ro, "gpusPerEngine", "spec.rollout", 1, 0, 16),
        port=r.integer(ro, "port", "spec.rollout", 30000, 1024, 65535),
        sglang_args=r.mapping(ro, "sglangArgs", "spec.rollout"),
        placement=r.placement(ro, "spec.rollout"),
    )
    if rollout.backend == "sglang":
        if rollout.gpus_per_engine < 1:
            problems.append("spec.rollout.gpusPerEngine: SGLang engines need at least 1 GPU; "
                            "use rollout.backend: reference for CPU jobs")
        if model.hf_path is None:
            problems.append("spec.model.hfPath: SGLang engines need a model directory; "
                            "set it, or use rollout.backend: reference for a tiny random model")
    g = r.section(spec, "gang", "spec")
    gang = GangSpec(
        scheduler=r.string(g, "scheduler", "spec.gang", "none", GANG_SCHEDULERS) or "none",
        timeout_seconds=r.integer(g, "timeoutSeconds", "spec.gang", 600, 1, 10**7),
        queue=r.string(g, "queue", "spec.gang", None),
        scheduler_name=r.string(g, "schedulerName", "spec.gang", None),
    )
    if gang.scheduler == "kueue" and gang.queue is None:
        problems.append("spec.gang.queue: Kueue needs the LocalQueue name; set spec.gang.queue")
    c = r.section(spec, "checkpoint", "spec")
    vol = r.section(c, "volume", "spec.checkpoint")
    checkpoint = CheckpointSpec(
        claim_name=r.string(vol, "claimName", "spec.checkpoint.volume", None),
        mount_path=r.string(vol, "mountPath", "spec.checkpoint.volume", "/checkpoints") or "/checkpoints",
        interval=r.integer(c, "interval", "spec.checkpoint", 50, 0, 10**9),
        keep_last=r.integer(c, "keepLast", "spec.checkpoint", 2, 1, 10**6),
    )
    r.object_name(checkpoint.claim_name, "spec.checkpoint.volume.claimName")
    f = r.section(spec, "faultTolerance", "spec")
    fault_tolerance = FaultToleranceSpec(
        max_engine_restarts=r.integer(f, "maxEngineRestarts", "spec.faultTolerance", 3, 0, 10**6),
        max_trainer_restarts=r.integer(f, "maxTrainerRestarts", "spec.faultTolerance", 3, 0, 10**6),
    )
    metrics = r.section(spec, "metrics", "spec")
    metrics_port = r.integer(metrics, "port", "spec.metrics", 9400, 1024, 65535)
    allow_from = r.listing(metrics, "allowFrom", "spec.metrics")
    for i, peer in enumerate(allow_from):
        if not isinstance(peer, Mapping) or not peer or any(k not in PEER_KEYS for k in peer):
            problems.append(f"spec.metrics.allowFrom[{i}]: expected a NetworkPolicyPeer with only "
                            f"{', '.join(PEER_KEYS)}, got {peer!r}")
    if metrics_port == rollout.port:
        problems.append(f"spec.metrics.port: {metrics_port} collides with spec.rollout.port; pick another port")
    env = r.listing(spec, "env", "spec")
    for i, e in enumerate(env):
        if not isinstance(e, Mapping) or not e.get("name"):
            problems.append(f"spec.env[{i}]: each entry needs a name (an EnvVar object)")
        elif e["name"] in RESERVED_ENV:
            problems.append(f"spec.env[{i}]: {e['name']} is set by the operator from the job's key Secret "
                            f"(<job>-api-key); remove it: a key in the MilesJob is readable by anyone who can read it")
        elif kube_fields.env_name(str(e["name"])):
            problems.append(f"spec.env[{i}].name: {e['name']!r} {kube_fields.env_name(str(e['name']))}")
    pull_policy = r.string(spec, "imagePullPolicy", "spec", "IfNotPresent", ("Always", "IfNotPresent", "Never"))
    service_account = r.string(spec, "serviceAccountName", "spec", None)
    r.object_name(service_account, "spec.serviceAccountName")
    if problems:
        raise SpecError(problems)
    return JobSpec(
        name=name,
        namespace=str(meta.get("namespace") or "default"),
        uid=str(meta.get("uid") or ""),
        generation=int(meta.get("generation") or 0),
        image=str(image),
        image_pull_policy=pull_policy or "IfNotPresent",
        service_account=service_account,
        overrides=overrides,
        env=[dict(e) for e in env],
        model=model,
        trainer=trainer,
        rollout=rollout,
        gang=gang,
        checkpoint=checkpoint,
        fault_tolerance=fault_tolerance,
        metrics_port=metrics_port,
        metrics_allow_from=[dict(p) for p in allow_from if isinstance(p, Mapping)],
    )
