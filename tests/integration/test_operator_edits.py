"""Edits of running MilesJobs and what the operator refuses, against a real kube-apiserver + etcd with the
operator running (the fixtures of test_operator_apiserver.py; the tests play the Job controller and kubelet).

- scaling engines 1 -> 2 -> 1 adds and removes engine pods only: the trainer Job keeps its uid, its step
  keeps increasing, and the ConfigMap's engine list (which the trainer's fleet follows) changes;
- a trainer-restart edit is refused without a checkpoint volume and applied (trainer Job replaced) with one;
- an invalid edit is refused with condition InvalidSpec, the job keeps running, and reverting it recovers;
- a trainer whose metrics answer `miles_lite_step NaN`: the counters are saved and the engine budget holds;
- a pod field only the API server refuses: the status names it, nothing is created or retried, a fix recovers.
"""

# Test functions take the imported fixtures as parameters of the same names.
# ruff: noqa: F811

from __future__ import annotations

import http.server
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from kopf.testing import KopfRunner
from test_operator_apiserver import (  # noqa: F401 - module fixtures, one control plane for this module
    INTERVAL_S,
    NS,
    api,
    api_client,
    control_plane,
    example,
    job_status,
    milesjob,
    operator,
    uid,
    wait_for,
)

from launcher.kube import KubeApi
from launcher.reconcile import COMPLETION_INDEX_ANNOTATION
from launcher.spec import API_VERSION
from launcher.status import STEP_ANNOTATION

pytestmark = [pytest.mark.integration,
              pytest.mark.filterwarnings("ignore::urllib3.exceptions.InsecureRequestWarning")]


def conditions(api: KubeApi, name: str) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in job_status(api, name).get("conditions") or []}


def condition_is(api: KubeApi, name: str, type_: str, status: str, reason: str | None = None) -> bool:
    c = conditions(api, name).get(type_)
    return c is not None and c["status"] == status and (reason is None or c["reason"] == reason)


def run_trainer(api: KubeApi, name: str, step: int | None = None, pod_ip: str | None = None) -> None:
    """Play the Job controller and kubelet: the trainer Job is active and its pod 0 runs (reporting `step`)."""
    api.patch("batch/v1", "Job", NS, f"{name}-trainer", {"status": {"active": 1}}, "status")
    annotations = {COMPLETION_INDEX_ANNOTATION: "0"}
    if step is not None:
        annotations[STEP_ANNOTATION] = str(step)
    api.create({"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": f"{name}-trainer-0-abcde", "namespace": NS,
                             "labels": {"mileslite.dev/job": name, "mileslite.dev/role": "trainer"},
                             "annotations": annotations},
                "spec": {"containers": [{"name": "trainer", "image": "img"}]}})
    if pod_ip:
        api.patch("v1", "Pod", NS, f"{name}-trainer-0-abcde", {"status": {"phase": "Running", "podIP": pod_ip}},
                  "status")


def report_step(api: KubeApi, name: str, step: int) -> None:
    api.patch("v1", "Pod", NS, f"{name}-trainer-0-abcde", {"metadata": {"annotations": {STEP_ANNOTATION: str(step)}}})
    wait_for(lambda: job_status(api, name).get("step") == step, f"status.step={step}")


def engine_list(api: KubeApi, name: str) -> list[str]:
    return (api.get("v1", "ConfigMap", NS, f"{name}-config") or {}).get("data", {}).get("engines", "").split()


def patch_spec(api: KubeApi, name: str, spec: dict[str, Any]) -> None:
    api.patch(API_VERSION, "MilesJob", NS, name, {"spec": spec})


def test_scaling_engines_keeps_the_trainer_running(api: KubeApi, operator: KopfRunner):
    api.create(example("tiny-cpu.yaml", "scale", rollout={"backend": "reference", "engines": 1, "gpusPerEngine": 0}))
    wait_for(lambda: api.get("batch/v1", "Job", NS, "scale-trainer"), "trainer Job")
    run_trainer(api, "scale", step=3)
    wait_for(lambda: job_status(api, "scale").get("phase") == "Running", "phase Running")
    trainer = uid(api.get("batch/v1", "Job", NS, "scale-trainer"))
    engine0 = uid(api.get("v1", "Pod", NS, "scale-rollout-0"))
    assert len(engine_list(api, "scale")) == 1

    patch_spec(api, "scale", {"rollout": {"engines": 2}})
    wait_for(lambda: api.get("v1", "Pod", NS, "scale-rollout-1"), "engine pod 1 added")
    wait_for(lambda: condition_is(api, "scale", "Scaling", "True", "ScaleUp"), "condition Scaling/ScaleUp")
    assert len(engine_list(api, "scale")) == 2
    report_step(api, "scale", 5)
    assert uid(api.get("batch/v1", "Job", NS, "scale-trainer")) == trainer
    assert uid(api.get("v1", "Pod", NS, "scale-rollout-0")) == engine0

    patch_spec(api, "scale", {"rollout": {"engines": 1}})
    wait_for(lambda: api.get("v1", "Pod", NS, "scale-rollout-1") is None, "engine pod 1 removed")
    wait_for(lambda: condition_is(api, "scale", "Scaling", "True", "ScaleDown"), "condition Scaling/ScaleDown")
    assert len(engine_list(api, "scale")) == 1
    report_step(api, "scale", 7)
    status = job_status(api, "scale")
    assert uid(api.get("batch/v1", "Job", NS, "scale-trainer")) == trainer
    assert uid(api.get("v1", "Pod", NS, "scale-rollout-0")) == engine0
    assert status["phase"] == "Running" and status["trainerRestarts"] == 0 and status["engineRestarts"] == 0
    assert condition_is(api, "scale", "InvalidSpec", "False", "Applied")
    assert condition_is(api, "scale", "Restarting", "False")


def test_trainer_restart_edit_needs_a_checkpoint_volume(api: KubeApi, operator: KopfRunner):
    api.create(example("tiny-cpu.yaml", "nockpt"))
    wait_for(lambda: api.get("batch/v1", "Job", NS, "nockpt-trainer"), "trainer Job")
    run_trainer(api, "nockpt", step=12)
    wait_for(lambda: job_status(api, "nockpt").get("step") == 12, "status.step=12")
    trainer = uid(api.get("batch/v1", "Job", NS, "nockpt-trainer"))
    overrides = milesjob(api, "nockpt")["spec"]["overrides"]
    patch_spec(api, "nockpt", {"overrides": [*overrides, "experiment.steps=40"]})
    wait_for(lambda: condition_is(api, "nockpt", "InvalidSpec", "True", "NoCheckpointVolume"), "edit refused")
    c = conditions(api, "nockpt")["InvalidSpec"]
    assert "spec.overrides changed" in c["message"] and "step 12" in c["message"], c
    assert uid(api.get("batch/v1", "Job", NS, "nockpt-trainer")) == trainer
    assert "experiment.steps=40" not in api.get("v1", "ConfigMap", NS, "nockpt-config")["data"]["overrides"]
    assert job_status(api, "nockpt")["phase"] == "Running"
    patch_spec(api, "nockpt", {"overrides": overrides})  # reverted: applied again, nothing restarted
    wait_for(lambda: condition_is(api, "nockpt", "InvalidSpec", "False", "Applied"), "reverted edit applied")
    assert uid(api.get("batch/v1", "Job", NS, "nockpt-trainer")) == trainer

    # With a checkpoint volume the same edit restarts the trainer (it resumes from the newest checkpoint).
    api.create(example("tiny-cpu.yaml", "ckpt", checkpoint={"volume": {"claimName": "ckpt-data"}}))
    wait_for(lambda: api.get("batch/v1", "Job", NS, "ckpt-trainer"), "trainer Job")
    run_trainer(api, "ckpt", step=12)
    wait_for(lambda: job_status(api, "ckpt").get("phase") == "Running", "phase Running")
    trainer = uid(api.get("batch/v1", "Job", NS, "ckpt-trainer"))
    engines = [uid(api.get("v1", "Pod", NS, f"ckpt-rollout-{i}")) for i in range(2)]
    patch_spec(api, "ckpt", {"overrides": [*overrides, "experiment.steps=40"]})
    wait_for(lambda: uid(api.get("batch/v1", "Job", NS, "ckpt-trainer")) not in (None, trainer), "trainer replaced")
    wait_for(lambda: condition_is(api, "ckpt", "Restarting", "True", "SpecChanged"), "condition Restarting")
    assert "experiment.steps=40" in api.get("v1", "ConfigMap", NS, "ckpt-config")["data"]["overrides"]
    assert [uid(api.get("v1", "Pod", NS, f"ckpt-rollout-{i}")) for i in range(2)] != engines  # they read it too
    assert job_status(api, "ckpt")["trainerRestarts"] == 0  # an applied edit is not a failure


def test_invalid_edit_is_refused_and_the_job_keeps_running(api: KubeApi, operator: KopfRunner):
    api.create(example("tiny-cpu.yaml", "edit"))
    wait_for(lambda: api.get("batch/v1", "Job", NS, "edit-trainer"), "trainer Job")
    run_trainer(api, "edit", step=4)
    wait_for(lambda: job_status(api, "edit").get("phase") == "Running", "phase Running")
    trainer = uid(api.get("batch/v1", "Job", NS, "edit-trainer"))
    engines = [uid(api.get("v1", "Pod", NS, f"edit-rollout-{i}")) for i in range(2)]
    overrides = milesjob(api, "edit")["spec"]["overrides"]
    patch_spec(api, "edit", {"overrides": [*overrides, "cluster=local"]})
    wait_for(lambda: condition_is(api, "edit", "InvalidSpec", "True", "InvalidSpec"), "edit refused")
    message = conditions(api, "edit")["InvalidSpec"]["message"]
    assert f"spec.overrides[{len(overrides)}]: cluster is set by the operator" in message, message
    assert "keeps its last applied spec" in job_status(api, "edit")["message"]
    # A pod field only the API server checks (a downward-API path): refused through the server's dry run.
    patch_spec(api, "edit", {"overrides": overrides,
                             "env": [{"name": "X", "valueFrom": {"fieldRef": {"fieldPath": "spec.nothing"}}}]})
    wait_for(lambda: condition_is(api, "edit", "InvalidSpec", "True", "RefusedByAPIServer"), "pod field refused")
    assert "fieldPath" in conditions(api, "edit")["InvalidSpec"]["message"]
    status = job_status(api, "edit")
    assert status["phase"] == "Running" and "Failed" not in conditions(api, "edit")
    assert uid(api.get("batch/v1", "Job", NS, "edit-trainer")) == trainer
    assert [uid(api.get("v1", "Pod", NS, f"edit-rollout-{i}")) for i in range(2)] == engines
    patch_spec(api, "edit", {"env": None})
    wait_for(lambda: condition_is(api, "edit", "InvalidSpec", "False", "Applied"), "fixed spec applied")
    assert uid(api.get("batch/v1", "Job", NS, "edit-trainer")) == trainer


@pytest.fixture
def nan_metrics() -> Iterator[int]:
    """A trainer metrics endpoint answering a NaN step; yields its port."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
            body = b"# TYPE miles_lite_step gauge\nmiles_lite_step NaN\n"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            return

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield int(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_nan_metrics_keep_counters_and_the_engine_budget(api: KubeApi, operator: KopfRunner, nan_metrics: int):
    api.create(example("tiny-cpu.yaml", "nan", rollout={"backend": "reference", "engines": 1, "gpusPerEngine": 0},
                       metrics={"port": nan_metrics}, faultTolerance={"maxEngineRestarts": 2}))
    wait_for(lambda: api.get("batch/v1", "Job", NS, "nan-trainer"), "trainer Job")
    run_trainer(api, "nan", pod_ip="127.0.0.1")
    wait_for(lambda: condition_is(api, "nan", "ProgressReported", "False", "MetricsUnreadable"),
             "condition ProgressReported/MetricsUnreadable")
    assert "miles_lite_step is nan" in conditions(api, "nan")["ProgressReported"]["message"]
    for restarts in (1, 2):
        pod = uid(api.get("v1", "Pod", NS, "nan-rollout-0"))
        api.patch("v1", "Pod", NS, "nan-rollout-0", {"status": {"phase": "Failed"}}, "status")
        wait_for(lambda p=pod: uid(api.get("v1", "Pod", NS, "nan-rollout-0")) not in (None, p), "engine replaced")
        wait_for(lambda r=restarts: job_status(api, "nan").get("engineRestarts") == r, f"engineRestarts={restarts}")
    api.patch("v1", "Pod", NS, "nan-rollout-0", {"status": {"phase": "Failed"}}, "status")
    wait_for(lambda: job_status(api, "nan").get("phase") == "Failed", "phase Failed")
    status = job_status(api, "nan")
    assert status["engineRestarts"] == 2 and conditions(api, "nan")["Failed"]["reason"] == "EngineRestartsExhausted"
    assert condition_is(api, "nan", "Reconciled", "True")
    # A failed job stops what it started: no engine pod, trainer workers scaled to zero.
    wait_for(lambda: api.get("v1", "Pod", NS, "nan-rollout-0") is None, "engines stopped")
    # The trainer Job is scaled down in the same reconcile pass, but not necessarily before the pods are gone.
    wait_for(lambda: api.get("batch/v1", "Job", NS, "nan-trainer")["spec"]["parallelism"] == 0,
             "trainer workers scaled to zero")


def test_pod_field_refused_by_the_api_server_is_named_once(api: KubeApi, operator: KopfRunner,
                                                          caplog: pytest.LogCaptureFixture):
    # Valid for the CRD schema and the operator's own checks; the server refuses the pods (downward-API path).
    bad_env = [{"name": "X", "valueFrom": {"fieldRef": {"fieldPath": "spec.nothing"}}}]
    api.create(example("tiny-cpu.yaml", "refused", env=bad_env))
    wait_for(lambda: job_status(api, "refused").get("phase") == "Failed", "phase Failed")
    status = job_status(api, "refused")
    assert "the API server refuses" in status["message"] and "fieldPath" in status["message"], status["message"]
    assert condition_is(api, "refused", "InvalidSpec", "True", "InvalidSpec")
    assert conditions(api, "refused")["Failed"]["reason"] == "InvalidSpec"
    # Nothing was created, and the job is not retried until its spec changes.
    assert api.get("batch/v1", "Job", NS, "refused-trainer") is None
    assert api.get("v1", "ConfigMap", NS, "refused-config") is None
    time.sleep(4 * INTERVAL_S)  # absence over four reconcile passes: a retry would try the Job again
    refusals = [r for r in caplog.records if r.name == "launcher" and "refuses Job refused-trainer" in r.message]
    assert len(refusals) == 1, [r.message for r in refusals]
    assert job_status(api, "refused") == status
    # A node-selector key the API server would refuse is named by the operator; the fix reopens the job.
    patch_spec(api, "refused", {"env": None, "trainer": {"nodeSelector": {"bad key!": "x"}}})
    wait_for(lambda: "spec.trainer.nodeSelector['bad key!']" in job_status(api, "refused").get("message", ""),
             "node-selector key named")
    assert job_status(api, "refused")["phase"] == "Failed"
    patch_spec(api, "refused", {"trainer": {"nodeSelector": None}})
    wait_for(lambda: job_status(api, "refused").get("phase") == "Pending", "reopened as Pending")
    wait_for(lambda: api.get("batch/v1", "Job", NS, "refused-trainer"), "trainer Job created")
    assert condition_is(api, "refused", "Failed", "False", "SpecChanged")
    assert condition_is(api, "refused", "InvalidSpec", "False", "Applied")
