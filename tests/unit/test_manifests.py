"""Offline validation: k8s/ manifests and rendered objects against Kubernetes' schemas, examples against the CRD."""

from __future__ import annotations

import copy
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from launcher.crd_schema import json_schema, load_crd, openapi_schema, validation_errors
from launcher.kube import PLURALS
from launcher.render import render

K8S = Path(__file__).resolve().parents[2] / "k8s"
K8S_VERSION = "1.30"
MANIFESTS = sorted(p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
EXAMPLES = sorted(p.name for p in (K8S / "examples").glob("*.yaml"))


def docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


@pytest.fixture(scope="module")
def crd() -> dict:
    return load_crd(K8S / "crd.yaml")


@pytest.mark.parametrize("name", MANIFESTS)
def test_manifest_validates_strictly(name):
    for obj in docs(K8S / name):
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_kustomization_lists_every_manifest():
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert sorted(kust["resources"]) == MANIFESTS


def test_kubectl_kustomize_output_validates():
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed; the kustomization is checked by test_kustomization_lists_every_manifest")
    out = subprocess.run([kubectl, "kustomize", str(K8S)], capture_output=True, text=True, timeout=60, check=True)
    objs = [d for d in yaml.safe_load_all(out.stdout) if d]
    assert {o["kind"] for o in objs} == {"CustomResourceDefinition", "Namespace", "ServiceAccount", "ClusterRole",
                                         "ClusterRoleBinding", "Deployment"}
    for obj in objs:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_matches_crd_schema(crd, name):
    (obj,) = docs(K8S / "examples" / name)
    assert validation_errors(crd, obj) == []


def test_invalid_job_lists_every_schema_error(crd):
    (obj,) = docs(K8S / "examples" / "gsm8k-gpu.yaml")
    bad = copy.deepcopy(obj)
    bad["spec"]["image"] = ""
    bad["spec"]["trainer"]["replicas"] = 0
    bad["spec"]["trainer"]["gpusPerReplica"] = "two"
    bad["spec"]["rollout"]["backend"] = "tgi"
    bad["spec"]["gang"]["scheduler"] = "slurm"
    bad["spec"]["metrics"]["port"] = 80
    bad["spec"]["trainer"]["tolerations"][0]["effect"] = "Sometimes"
    bad["spec"]["unknownField"] = 1
    errors = validation_errors(crd, bad)
    assert len(errors) == 9, errors  # the empty image breaks minLength and pattern
    paths = {e.split(":")[0] for e in errors}
    assert paths == {"spec", "spec.image", "spec.trainer.replicas", "spec.trainer.gpusPerReplica",
                     "spec.rollout.backend", "spec.gang.scheduler", "spec.metrics.port",
                     "spec.trainer.tolerations.0.effect"}


def test_converter_keeps_pass_through_objects_open(crd):
    schema = json_schema(openapi_schema(crd))
    rollout = schema["properties"]["spec"]["properties"]["rollout"]
    assert rollout["additionalProperties"] is False
    assert "additionalProperties" not in rollout["properties"]["sglangArgs"]
    requests = rollout["properties"]["resources"]["properties"]["requests"]
    assert requests["additionalProperties"]["anyOf"] == [{"type": "integer"}, {"type": "string"}]


@pytest.mark.parametrize("gang", [{"scheduler": "none"}, {"scheduler": "volcano", "queue": "q"},
                                  {"scheduler": "coscheduling"}, {"scheduler": "kueue", "queue": "q"}])
@pytest.mark.parametrize("name", EXAMPLES)
def test_rendered_objects_validate_strictly(name, gang):
    (body,) = docs(K8S / "examples" / name)
    body["metadata"].update(namespace="ns", uid="00000000-0000-0000-0000-000000000001")
    body["spec"]["gang"] = gang
    body["spec"]["image"] = "registry.example/miles-lite:1.0"  # what the operator writes into the examples
    body["spec"]["trainer"]["replicas"] = 2
    for obj in render(body):
        if obj["kind"] == "PodGroup":
            # Not a built-in kind: checked field by field in test_render.
            continue
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_status_schema_declares_every_field_the_operator_writes(crd):
    """The API server prunes undeclared status fields, so each written key must be in the CRD."""
    status_props = set(openapi_schema(crd)["properties"]["status"]["properties"])
    written = {"phase", "message", "observedGeneration", "conditions", "startTime", "completionTime",
               "enginesReady", "enginesDesired", "engines", "trainerActive", "step", "lastCheckpoint",
               "trainerRestarts", "engineRestarts", "replacing"}
    assert written <= status_props, written - status_props


def test_rbac_grants_the_operator_exactly_what_it_uses():
    role = next(d for d in docs(K8S / "rbac.yaml") if d["kind"] == "ClusterRole")
    grants: dict[str, set[str]] = {}
    for rule in role["rules"]:
        for res in rule["resources"]:
            grants.setdefault(res, set()).update(rule["verbs"])
    assert "*" not in str(role["rules"])
    # The verbs launcher/ calls per resource (reconcile.py, security.py, kopf's watch and bookkeeping).
    assert grants == {
        "customresourcedefinitions": {"list", "watch"}, "namespaces": {"list", "watch"},
        "milesjobs": {"get", "list", "watch", "patch"}, "milesjobs/status": {"get", "patch"},
        "configmaps": {"get", "create", "patch"}, "services": {"get", "create", "patch"},
        "networkpolicies": {"get", "create", "patch"}, "podgroups": {"get", "create", "patch"},
        "pods": {"get", "list", "create", "delete"}, "jobs": {"get", "create", "patch", "delete"},
        "secrets": {"create"}, "events": {"create"},
    }
    assert set(PLURALS.values()) <= set(grants)
    binding = next(d for d in docs(K8S / "rbac.yaml") if d["kind"] == "ClusterRoleBinding")
    deployment = docs(K8S / "deployment.yaml")[0]
    assert binding["subjects"][0]["name"] == deployment["spec"]["template"]["spec"]["serviceAccountName"]


def test_schema_refuses_pod_fields_the_api_server_would(crd):
    (obj,) = docs(K8S / "examples" / "tiny-cpu.yaml")
    bad = copy.deepcopy(obj)
    bad["spec"]["image"] = "my image:1"
    bad["spec"]["env"] = [{"name": "1 bad name", "value": "x"}]
    bad["spec"]["trainer"]["resources"] = {"requests": {"cpu": "lots", "memory": "2Gi"}, "limits": {"cpu": 2}}
    bad["spec"]["rollout"]["nodeSelector"] = {"pool": "has spaces"}
    paths = sorted(e.split(":")[0] for e in validation_errors(crd, bad))
    assert paths == ["spec.env.0.name", "spec.image", "spec.rollout.nodeSelector.pool",
                     "spec.trainer.resources.requests.cpu"], paths
