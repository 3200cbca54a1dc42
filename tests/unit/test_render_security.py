"""The job's pods keep to themselves: key Secret mounted (never in env or the CR), NetworkPolicy, security contexts."""

from __future__ import annotations

import base64
import copy
import json

import pytest
from test_render import by_kind, example

from launcher.render import key_secret_metadata, render
from launcher.security import KEY_DIR, ensure_key_secret, render_key_secret, secret_name
from launcher.spec import SpecError, parse_job
from miles_lite.net.api_key import ENV_KEY_FILE


def _pods(objs: list[dict]) -> list[dict]:
    job = by_kind(objs, "Job")[0]["spec"]["template"]
    return [job, *by_kind(objs, "Pod")]


def test_every_pod_mounts_the_key_secret_and_runs_unprivileged() -> None:
    objs = render(example("tiny-cpu.yaml"))
    for pod in _pods(objs):
        spec = pod["spec"]
        (container,) = spec["containers"]
        (volume,) = [v for v in spec["volumes"] if "secret" in v]
        assert volume["secret"] == {"secretName": "tiny-cpu-api-key", "defaultMode": 0o440}
        (mount,) = [m for m in container["volumeMounts"] if m["name"] == volume["name"]]
        assert mount == {"name": volume["name"], "mountPath": KEY_DIR, "readOnly": True}
        env = {e["name"]: e for e in container["env"]}
        assert env[ENV_KEY_FILE] == {"name": ENV_KEY_FILE, "value": f"{KEY_DIR}/api-key"}
        assert "MILES_API_KEY" not in env and "secretKeyRef" not in json.dumps(container["env"])
        assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] > 0
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert container["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                                "capabilities": {"drop": ["ALL"]}}
        # What a process writes off its volumes goes to emptyDirs, the root filesystem being read-only.
        writable = {m["mountPath"] for m in container["volumeMounts"] if not m.get("readOnly")}
        assert {"/tmp", "/work", "/checkpoints"} <= writable  # the run's outputs: its volume, or scratch
        assert spec["automountServiceAccountToken"] is False


def test_network_policy_admits_only_the_job_and_metrics_scrapers() -> None:
    prometheus = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    objs = render(example("tiny-cpu.yaml", metrics={"port": 9400, "allowFrom": [prometheus]}))
    (policy,) = by_kind(objs, "NetworkPolicy")
    spec = policy["spec"]
    assert spec["podSelector"] == {"matchLabels": {"mileslite.dev/job": "tiny-cpu"}}
    assert spec["policyTypes"] == ["Ingress"]
    same_job, metrics = spec["ingress"]
    assert same_job == {"from": [{"podSelector": {"matchLabels": {"mileslite.dev/job": "tiny-cpu"}}}]}
    assert metrics["ports"] == [{"protocol": "TCP", "port": 9400}]
    assert prometheus in metrics["from"]
    operator = metrics["from"][0]
    assert operator["podSelector"] == {"matchLabels": {"app.kubernetes.io/name": "miles-lite-operator"}}
    # Every pod of the job is selected by it.
    for pod in _pods(objs):
        assert pod["metadata"]["labels"]["mileslite.dev/job"] == "tiny-cpu"


def test_the_milesjob_cannot_carry_a_key_and_peers_are_checked() -> None:
    body = example("tiny-cpu.yaml", env=[{"name": "MILES_API_KEY", "value": "x" * 32}],
                   metrics={"allowFrom": [{"ipBlock": {"cidr": "10.0.0.0/8"}}, {"bogus": {}}]})
    with pytest.raises(SpecError) as err:
        parse_job(body)
    message = str(err.value)
    assert "spec.env[0]: MILES_API_KEY is set by the operator" in message
    assert "spec.metrics.allowFrom[1]" in message and "allowFrom[0]" not in message


class _Api:
    def __init__(self) -> None:
        self.objects: dict[tuple[str, str], dict] = {}

    def create(self, obj: dict) -> dict:  # the operator may only create Secrets: no get here
        from launcher.kube import Conflict

        if (obj["kind"], obj["metadata"]["name"]) in self.objects:
            raise Conflict("exists")
        self.objects[(obj["kind"], obj["metadata"]["name"])] = copy.deepcopy(obj)
        return obj


def test_key_secret_is_created_once_with_a_fresh_key_and_owned_by_the_job() -> None:
    job = parse_job(example("tiny-cpu.yaml"))
    api = _Api()
    assert ensure_key_secret(api, job, key_secret_metadata(job)) == "created"
    secret = api.objects[("Secret", secret_name(job))]
    key = base64.b64decode(secret["data"]["api-key"]).decode()
    assert len(key) >= 40
    assert secret["metadata"]["ownerReferences"][0]["kind"] == "MilesJob"
    assert ensure_key_secret(api, job, key_secret_metadata(job)) == "unchanged"
    assert base64.b64decode(api.objects[("Secret", secret_name(job))]["data"]["api-key"]).decode() == key
    other = render_key_secret(job, key_secret_metadata(job), "k" * 32)
    assert base64.b64decode(other["data"]["api-key"]).decode() == "k" * 32
    # Nothing the renderer produces holds the key.
    assert key not in json.dumps(render(example("tiny-cpu.yaml")))
