"""A MilesJob's key Secret, NetworkPolicy and security contexts on a real kube-apiserver with RBAC enforced.

The rendered objects are applied with kubectl (Debian's kubernetes-client, as scripts/install-services.sh
unpacks it) and read back unchanged, so the server accepts every field; then the operator's reconcile pass
runs as the operator's service account (impersonated) under k8s/rbac.yaml, which must let it create
everything a job needs and must not let it read a Secret.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client, config
from services.kube_apiserver import ControlPlane, ready_apiserver, start_control_plane
from test_kubernetes_pods import kubectl_binary

from launcher.handlers import utc_now
from launcher.kube import KubeApi
from launcher.reconcile import OperatorConfig, Reconciler
from launcher.render import key_secret_metadata, render
from launcher.security import KEY_DIR, render_key_secret, secret_name
from launcher.spec import API_VERSION, parse_job
from miles_lite.net.api_key import ENV_KEY_FILE

pytestmark = [pytest.mark.integration,
              pytest.mark.filterwarnings("ignore::urllib3.exceptions.InsecureRequestWarning")]

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "k8s"
OPERATOR = "system:serviceaccount:miles-lite-system:miles-lite-operator"
PROMETHEUS = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}


def _missing(reason: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"in CI {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    if ready_apiserver() is None:
        _missing("kube-apiserver is not built (scripts/build-kube-apiserver.sh)")
    cp = start_control_plane(tmp_path_factory.mktemp("kube"), authorization="RBAC")
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

    def run(*args: str, stdin: str | None = None, check: bool = True) -> str:
        done = subprocess.run([str(binary), *args], capture_output=True, text=True, env=env, cwd=REPO, input=stdin,
                              timeout=120)
        if check:
            assert done.returncode == 0, f"kubectl {' '.join(args)}: {done.stderr}"
        return done.stdout.strip()

    return run


def _client(control_plane: ControlPlane, as_user: str | None = None) -> KubeApi:
    cfg = client.Configuration()
    config.load_kube_config(config_file=str(control_plane.kubeconfig), client_configuration=cfg)
    api_client = client.ApiClient(cfg)
    if as_user:
        api_client.set_default_header("Impersonate-User", as_user)
    return KubeApi(api_client)


def _job(name: str, namespace: str = "default", uid: str = "0b8c9e8e-0000-4000-8000-000000000001") -> dict[str, Any]:
    body = yaml.safe_load((K8S / "examples" / "tiny-cpu.yaml").read_text())
    body["metadata"] = {"name": name, "namespace": namespace, "uid": uid, "generation": 1}
    body["spec"]["image"] = "registry.example/miles-lite:1.0"
    body["spec"]["metrics"] = {"port": 9400, "allowFrom": [PROMETHEUS]}
    return body


def test_rendered_objects_apply_with_kubectl_and_keep_every_field(kubectl, control_plane: ControlPlane) -> None:
    body = _job("applied")
    job = parse_job(body)
    objs = render(body)
    secret = render_key_secret(job, key_secret_metadata(job), "s" * 43)
    # The trainer Job is an Indexed Job, which this 1.20 server does not know; its pods' spec is the engines'
    # (render._pod_spec), checked here on the engine pods.
    stream = yaml.safe_dump_all([secret, *(o for o in objs if o["kind"] != "Job")], sort_keys=False)
    out = kubectl("apply", "-f", "-", stdin=stream)
    assert "networkpolicy.networking.k8s.io/applied created" in out and "secret/applied-api-key created" in out

    live = json.loads(kubectl("get", "networkpolicy", "applied", "-o", "json"))
    (policy,) = [o for o in objs if o["kind"] == "NetworkPolicy"]
    assert live["spec"] == policy["spec"]
    live_secret = json.loads(kubectl("get", "secret", secret_name(job), "-o", "json"))
    assert base64.b64decode(live_secret["data"]["api-key"]).decode() == "s" * 43
    for rendered in [o for o in objs if o["kind"] == "Pod"]:
        pod = json.loads(kubectl("get", "pod", rendered["metadata"]["name"], "-o", "json"))
        spec, want = pod["spec"], rendered["spec"]
        assert spec["securityContext"] == want["securityContext"]
        (container,), (wanted,) = spec["containers"], want["containers"]
        assert container["securityContext"] == wanted["securityContext"]
        assert {"name": "api-key", "mountPath": KEY_DIR, "readOnly": True} in container["volumeMounts"]
        assert {"name": ENV_KEY_FILE, "value": f"{KEY_DIR}/api-key"} in container["env"]
        (volume,) = [v for v in spec["volumes"] if v["name"] == "api-key"]
        assert volume["secret"] == {"secretName": "applied-api-key", "defaultMode": 0o440}
        assert spec["automountServiceAccountToken"] is False


def test_operator_role_creates_a_job_and_reads_no_secret(kubectl, control_plane: ControlPlane) -> None:
    for manifest in ("crd.yaml", "namespace.yaml", "serviceaccount.yaml", "rbac.yaml"):
        kubectl("apply", "-f", str(K8S / manifest))
    kubectl("wait", "--for", "condition=established", "--timeout=60s", "crd/milesjobs.mileslite.dev")
    admin = _client(control_plane)
    body = _job("guarded")
    del body["metadata"]["uid"], body["metadata"]["generation"]
    stored = admin.create(body)
    assert stored["metadata"]["uid"]

    # One reconcile pass as the operator's own service account, under exactly k8s/rbac.yaml.
    operator = _client(control_plane, as_user=OPERATOR)
    patch = Reconciler(operator, OperatorConfig()).reconcile(operator.get_job("default", "guarded"), utc_now())
    assert patch.get("phase") != "Failed", patch
    assert admin.get("networking.k8s.io/v1", "NetworkPolicy", "default", "guarded") is not None
    # The Secret holds a fresh key, owned by the MilesJob; a second pass keeps it.
    secret = admin.get("v1", "Secret", "default", "guarded-api-key")
    key = base64.b64decode(secret["data"]["api-key"]).decode()
    assert len(key) >= 40 and secret["metadata"]["ownerReferences"][0]["uid"] == stored["metadata"]["uid"]
    Reconciler(operator, OperatorConfig()).reconcile(operator.get_job("default", "guarded"), utc_now())
    assert admin.get("v1", "Secret", "default", "guarded-api-key")["data"] == secret["data"]
    # Nor the MilesJob, nor any pod's environment carries the key.
    assert key not in json.dumps(admin.get_job("default", "guarded"))
    for pod in admin.list("v1", "Pod", "default", {"mileslite.dev/job": "guarded"}):
        assert key not in json.dumps(pod)

    def can(verb: str, resource: str, *extra: str) -> bool:
        return kubectl("auth", "can-i", verb, resource, *extra, "--as", OPERATOR, "-n", "default",
                       check=False) == "yes"

    assert can("create", "secrets")
    assert not any(can(verb, "secrets") for verb in ("get", "list", "watch", "patch", "update", "delete"))
    assert can("create", "networkpolicies.networking.k8s.io") and not can("delete", "networkpolicies.networking.k8s.io")
    assert not can("create", "pods", "--subresource=exec") and not can("create", "roles.rbac.authorization.k8s.io")
    with pytest.raises(Exception, match="403|Forbidden"):
        operator.get("v1", "Secret", "default", "guarded-api-key")
    assert admin.get(API_VERSION, "MilesJob", "default", "guarded") is not None
