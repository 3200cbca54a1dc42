"""The MilesJob CRD and the operator against a real kube-apiserver + etcd (no scheduler, no kubelet).

Pods never run here, so the tests play the missing controllers: they delete pods, set pod and Job
status through the status subresource, and create the trainer pod the Job controller would create.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kopf.testing import KopfRunner
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from services.kube_apiserver import ControlPlane, ready_apiserver, start_control_plane

from launcher.crd_schema import apply_defaults, load_crd, openapi_schema
from launcher.handlers import build_registry, build_settings
from launcher.kube import KubeApi, Refused
from launcher.reconcile import COMPLETION_INDEX_ANNOTATION, OperatorConfig, Reconciler
from launcher.render import HASH_ANNOTATION, render
from launcher.spec import API_VERSION
from launcher.status import CHECKPOINT_ANNOTATION, STEP_ANNOTATION

pytestmark = [pytest.mark.integration,
              # The test control plane serves a self-signed certificate.
              pytest.mark.filterwarnings("ignore::urllib3.exceptions.InsecureRequestWarning")]

K8S = Path(__file__).resolve().parents[2] / "k8s"
NS = "default"
# Seconds between reconcile passes; waits allow several passes on a loaded 2-core machine.
INTERVAL_S = 0.5
# The operator's image for jobs without spec.image (the examples name none).
DEFAULT_IMAGE = "registry.example/miles-lite:1.0"
WAIT_S = 45.0


@pytest.fixture(scope="module")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    if ready_apiserver() is None:
        reason = ("kube-apiserver is not built (run scripts/build-kube-apiserver.sh; about 5-9 minutes once, "
                  "cached in ${MILES_LITE_CACHE:-/var/cache/miles-lite}/kube-apiserver)")
        if os.environ.get("CI"):
            pytest.fail(f"in CI {reason}")
        pytest.skip(reason)
    cp = start_control_plane(tmp_path_factory.mktemp("kube"))
    old = os.environ.get("KUBECONFIG")
    os.environ["KUBECONFIG"] = str(cp.kubeconfig)
    try:
        yield cp
    finally:
        if old is None:
            os.environ.pop("KUBECONFIG", None)
        else:
            os.environ["KUBECONFIG"] = old
        cp.stop()


@pytest.fixture(scope="module")
def api_client(control_plane: ControlPlane) -> client.ApiClient:
    cfg = client.Configuration()
    config.load_kube_config(config_file=str(control_plane.kubeconfig), client_configuration=cfg)
    crd = load_crd(K8S / "crd.yaml")
    ext = client.ApiextensionsV1Api(client.ApiClient(cfg))
    ext.create_custom_resource_definition(body=crd)
    wait_for(lambda: any(c.type == "Established" and c.status == "True"
                         for c in (ext.read_custom_resource_definition(crd["metadata"]["name"]).status.conditions
                                   or [])), "the MilesJob CRD to be Established")
    return client.ApiClient(cfg)


@pytest.fixture(scope="module")
def api(api_client: client.ApiClient) -> KubeApi:
    return KubeApi(api_client)


class _Records(logging.Handler):
    """Keeps the operator's log messages (kopf logs through `logging`, not the runner's output)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture(scope="module")
def operator(api: KubeApi) -> Iterator[KopfRunner]:
    reconciler = Reconciler(api, OperatorConfig(interval_s=INTERVAL_S, job_image=DEFAULT_IMAGE, scrape_timeout_s=0.2))
    records = _Records()
    kopf_logger = logging.getLogger("kopf")
    kopf_logger.addHandler(records)
    runner = KopfRunner(["run", "--standalone", "--all-namespaces"], registry=build_registry(reconciler),
                        settings=build_settings(), timeout=60)
    try:
        with runner:
            yield runner
    finally:
        kopf_logger.removeHandler(records)
    assert runner.exit_code == 0, runner.output
    assert runner.exception is None
    log = "\n".join(records.messages)
    assert "Creation is processed" in log  # the log is captured, so the next check can fail
    # Every status write was kept: an undeclared field would have been pruned and reported by kopf.
    assert "inconsistencies" not in log, log


def wait_for(predicate: Callable[[], Any], what: str, timeout_s: float = WAIT_S, poll_s: float = 0.1) -> Any:
    """Poll `predicate` every `poll_s` until it returns a truthy value; fail naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(poll_s)


def example(name: str, job_name: str, **spec: Any) -> dict[str, Any]:
    body = yaml.safe_load((K8S / "examples" / name).read_text())
    body["metadata"] = {"name": job_name, "namespace": NS}
    body["spec"].update(spec)
    return body


def milesjob(api: KubeApi, name: str) -> dict[str, Any]:
    job = api.get(API_VERSION, "MilesJob", NS, name)
    assert job is not None, f"MilesJob {name} vanished"
    return job


def job_status(api: KubeApi, name: str) -> dict[str, Any]:
    return milesjob(api, name).get("status") or {}


def uid(obj: dict[str, Any] | None) -> str | None:
    return obj["metadata"]["uid"] if obj else None


def test_invalid_milesjob_is_rejected_with_every_schema_error(api: KubeApi):
    bad = example("gsm8k-gpu.yaml", "bad")
    bad["spec"]["image"] = ""
    bad["spec"]["trainer"]["replicas"] = 0
    bad["spec"]["rollout"]["backend"] = "tgi"
    bad["spec"]["gang"]["scheduler"] = "slurm"
    bad["spec"]["metrics"]["port"] = 80
    bad["spec"]["checkpoint"]["interval"] = -1
    with pytest.raises(Refused) as refused:
        api.create(bad)
    err = refused.value.__cause__
    assert isinstance(err, ApiException) and err.status == 422, err
    body = json.loads(err.body)
    fields = sorted({c["field"] for c in body["details"]["causes"]})  # an empty image fails two rules
    assert fields == ["spec.checkpoint.interval", "spec.gang.scheduler", "spec.image", "spec.metrics.port",
                      "spec.rollout.backend", "spec.trainer.replicas"], body["message"]
    assert 'Unsupported value: "tgi"' in body["message"]
    assert api.get(API_VERSION, "MilesJob", NS, "bad") is None


def test_server_defaults_equal_offline_defaults(api: KubeApi):
    minimal = {"apiVersion": API_VERSION, "kind": "MilesJob", "metadata": {"name": "defaults", "namespace": NS},
               "spec": {"image": "img", "rollout": {"backend": "reference", "gpusPerEngine": 0}}}
    created = api.create(minimal)
    try:
        offline = apply_defaults(openapi_schema(load_crd(K8S / "crd.yaml")), minimal)
        assert created["spec"] == offline["spec"]
    finally:
        api.delete(API_VERSION, "MilesJob", NS, "defaults")


def test_operator_renders_heals_and_reports(api: KubeApi, operator: KopfRunner):
    created = api.create(example("tiny-cpu.yaml", "tiny"))
    owner_uid = created["metadata"]["uid"]
    # The example names no image: the operator writes its default into the spec once.
    wait_for(lambda: milesjob(api, "tiny")["spec"].get("image") == DEFAULT_IMAGE, "spec.image defaulted")

    # Everything the renderer emits exists, current, and owned by the MilesJob.
    expected = render(milesjob(api, "tiny"))
    for obj in expected:
        kind, name = obj["kind"], obj["metadata"]["name"]
        live = wait_for(lambda o=obj: api.get(o["apiVersion"], o["kind"], NS, o["metadata"]["name"]),
                        f"{kind}/{name}")
        assert live["metadata"]["annotations"][HASH_ANNOTATION] == obj["metadata"]["annotations"][HASH_ANNOTATION]
        assert [r["uid"] for r in live["metadata"]["ownerReferences"]] == [owner_uid]
    wait_for(lambda: job_status(api, "tiny").get("enginesDesired") == 2, "status.enginesDesired=2")
    status = job_status(api, "tiny")
    assert status["phase"] == "Pending" and status["engines"] == "0/2"
    assert {c["type"]: c["status"] for c in status["conditions"]}["TrainerReady"] == "False"
    trainer_uid = uid(api.get("batch/v1", "Job", NS, "tiny-trainer"))

    # A deleted engine pod is recreated; the trainer is not touched.
    pod0 = uid(api.get("v1", "Pod", NS, "tiny-rollout-0"))
    assert api.delete("v1", "Pod", NS, "tiny-rollout-0")
    wait_for(lambda: uid(api.get("v1", "Pod", NS, "tiny-rollout-0")) not in (None, pod0), "engine 0 recreated")
    wait_for(lambda: job_status(api, "tiny").get("engineRestarts") == 1, "status.engineRestarts=1")

    # A failed engine pod is replaced too.
    pod1 = uid(api.get("v1", "Pod", NS, "tiny-rollout-1"))
    api.patch("v1", "Pod", NS, "tiny-rollout-1", {"status": {"phase": "Failed", "reason": "OOMKilled"}}, "status")
    wait_for(lambda: uid(api.get("v1", "Pod", NS, "tiny-rollout-1")) not in (None, pod1), "engine 1 replaced")
    wait_for(lambda: job_status(api, "tiny").get("engineRestarts") == 2, "status.engineRestarts=2")
    assert uid(api.get("batch/v1", "Job", NS, "tiny-trainer")) == trainer_uid

    # The trainer runs (as the Job controller would report) and reports progress on pod 0.
    api.patch("batch/v1", "Job", NS, "tiny-trainer", {"status": {"active": 1}}, "status")
    wait_for(lambda: job_status(api, "tiny").get("phase") == "Running", "phase Running")
    trainer_pod = {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "tiny-trainer-0-abcde", "namespace": NS,
                     "labels": {"mileslite.dev/job": "tiny", "mileslite.dev/role": "trainer"},
                     "annotations": {COMPLETION_INDEX_ANNOTATION: "0", STEP_ANNOTATION: "7",
                                     CHECKPOINT_ANNOTATION: "/checkpoints/checkpoints/step_5"}},
        "spec": {"containers": [{"name": "trainer", "image": "img"}]},
    }
    api.create(trainer_pod)
    wait_for(lambda: job_status(api, "tiny").get("step") == 7, "status.step=7")
    assert job_status(api, "tiny")["lastCheckpoint"] == "/checkpoints/checkpoints/step_5"
    engines_before = [uid(api.get("v1", "Pod", NS, f"tiny-rollout-{i}")) for i in range(2)]

    # A failed trainer is restarted (same command: it resumes from the newest checkpoint); engines stay.
    api.patch("batch/v1", "Job", NS, "tiny-trainer",
              {"status": {"active": 0, "failed": 1, "conditions": [
                  {"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded"}]}}, "status")
    wait_for(lambda: uid(api.get("batch/v1", "Job", NS, "tiny-trainer")) not in (None, trainer_uid),
             "trainer Job recreated")
    wait_for(lambda: job_status(api, "tiny").get("trainerRestarts") == 1, "status.trainerRestarts=1")
    assert job_status(api, "tiny")["phase"] == "Pending"
    assert [uid(api.get("v1", "Pod", NS, f"tiny-rollout-{i}")) for i in range(2)] == engines_before

    # A spec update scales the engines down and rewrites the overrides.
    api.patch(API_VERSION, "MilesJob", NS, "tiny", {"spec": {"rollout": {"engines": 1}}})
    wait_for(lambda: api.get("v1", "Pod", NS, "tiny-rollout-1") is None, "engine 1 removed")
    wait_for(lambda: "rollout.engines=1" in (api.get("v1", "ConfigMap", NS, "tiny-config") or {})
             .get("data", {}).get("overrides", "").splitlines(), "overrides rewritten")
    wait_for(lambda: job_status(api, "tiny").get("enginesDesired") == 1, "status.enginesDesired=1")
    assert job_status(api, "tiny")["engineRestarts"] == 2

    # Trainer pod 0 completes: the job succeeds, engines are stopped, trainer workers scaled to zero.
    trainer = api.get("batch/v1", "Job", NS, "tiny-trainer")
    assert trainer is not None
    # (API level 1.20 predates Indexed Jobs and prunes completedIndexes; the Complete condition stands in.)
    api.patch("batch/v1", "Job", NS, "tiny-trainer",
              {"status": {"succeeded": 1, "completedIndexes": "0",
                          "conditions": [{"type": "Complete", "status": "True"}]}}, "status")
    wait_for(lambda: job_status(api, "tiny").get("phase") == "Succeeded", "phase Succeeded")
    done = job_status(api, "tiny")
    assert done["completionTime"] and {c["type"]: c["status"] for c in done["conditions"]}["Complete"] == "True"
    wait_for(lambda: api.get("v1", "Pod", NS, "tiny-rollout-0") is None, "engines stopped")
    # The workers are scaled down by their own patch, which may land after the engines are gone.
    wait_for(lambda: api.get("batch/v1", "Job", NS, "tiny-trainer")["spec"]["parallelism"] == 0,
             "trainer workers scaled to zero")


def test_engine_budget_exhausted_fails_the_job(api: KubeApi, operator: KopfRunner):
    api.create(example("tiny-cpu.yaml", "fragile", rollout={"backend": "reference", "engines": 1,
                                                             "gpusPerEngine": 0},
                       faultTolerance={"maxEngineRestarts": 0}))
    wait_for(lambda: job_status(api, "fragile").get("enginesDesired") == 1, "first reconcile")
    api.patch("v1", "Pod", NS, "fragile-rollout-0", {"status": {"phase": "Failed"}}, "status")
    wait_for(lambda: job_status(api, "fragile").get("phase") == "Failed", "phase Failed")
    status = job_status(api, "fragile")
    failed = next(c for c in status["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "EngineRestartsExhausted" and status["engineRestarts"] == 0


def test_semantic_error_is_reported_in_status(api: KubeApi, operator: KopfRunner):
    # Valid for the schema, but SGLang engines need a model directory.
    api.create(example("tiny-cpu.yaml", "nomodel", rollout={"backend": "sglang", "engines": 1}))
    wait_for(lambda: job_status(api, "nomodel").get("phase") == "Failed", "phase Failed")
    assert "spec.model.hfPath" in job_status(api, "nomodel")["message"]
    assert api.get("batch/v1", "Job", NS, "nomodel-trainer") is None


def test_volcano_pod_groups_are_created(api: KubeApi, api_client: client.ApiClient, operator: KopfRunner):
    # Volcano's PodGroup CRD, reduced to what the operator writes (the real one is much larger).
    pg_crd = {
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": {"name": "podgroups.scheduling.volcano.sh"},
        "spec": {"group": "scheduling.volcano.sh", "scope": "Namespaced",
                 "names": {"kind": "PodGroup", "plural": "podgroups", "singular": "podgroup"},
                 "versions": [{"name": "v1beta1", "served": True, "storage": True, "schema": {"openAPIV3Schema": {
                     "type": "object", "x-kubernetes-preserve-unknown-fields": True}}}]},
    }
    ext = client.ApiextensionsV1Api(api_client)
    ext.create_custom_resource_definition(body=pg_crd)
    wait_for(lambda: any(c.type == "Established" and c.status == "True" for c in
                         (ext.read_custom_resource_definition("podgroups.scheduling.volcano.sh").status.conditions
                          or [])), "PodGroup CRD Established")
    api.create(example("tiny-cpu.yaml", "gang", gang={"scheduler": "volcano", "queue": "research"}))
    trainer_pg = wait_for(lambda: api.get("scheduling.volcano.sh/v1beta1", "PodGroup", NS, "gang-trainer"),
                          "trainer PodGroup")
    rollout_pg = wait_for(lambda: api.get("scheduling.volcano.sh/v1beta1", "PodGroup", NS, "gang-rollout"),
                          "rollout PodGroup")
    assert trainer_pg["spec"] == {"minMember": 1, "queue": "research"}
    assert rollout_pg["spec"] == {"minMember": 2, "queue": "research"}
    pod = wait_for(lambda: api.get("v1", "Pod", NS, "gang-rollout-0"), "engine pod")
    assert pod["spec"]["schedulerName"] == "volcano"
    assert pod["metadata"]["annotations"]["scheduling.k8s.io/group-name"] == "gang-rollout"
