"""The MilesJob status stays true under concurrent events, against a real kube-apiserver + etcd with the operator
running (the fixtures of test_operator_apiserver.py; the tests play the scheduler, Job controller and kubelet).

- engine pods failing while the spec is edited (each edit runs a pass beside the timer's): every failure is
  counted, once, so `maxEngineRestarts` holds whatever coincides;
- a status write conditioned on an old resourceVersion is refused by the server, and the pass composes it
  again on the stored status (nothing it counted is lost);
- a trainer Job deleted while it ran: condition Restarting (TrainerJobDeleted), counted once;
- engine pods the scheduler cannot place: condition EnginesScheduled False naming them, and the engine list the
  trainer follows leaves them out until they are scheduled;
- a MilesJob being deleted reads phase Terminating until it is gone.
"""

# Test functions take the imported fixtures as parameters of the same names.
# ruff: noqa: F811

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest
from kopf.testing import KopfRunner
from test_operator_apiserver import (  # noqa: F401 - module fixtures, one control plane for this module
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
from test_operator_edits import condition_is, conditions, engine_list, patch_spec, run_trainer

from launcher.kube import Conflict, KubeApi
from launcher.reconcile import OperatorConfig, Reconciler
from launcher.spec import API_VERSION

pytestmark = [pytest.mark.integration,
              pytest.mark.filterwarnings("ignore::urllib3.exceptions.InsecureRequestWarning")]

ROUNDS = 8


def fail_pod(api: KubeApi, name: str) -> None:
    api.patch("v1", "Pod", NS, name, {"status": {"phase": "Failed", "reason": "OOMKilled"}}, "status")


@pytest.fixture
def silent_metrics() -> Iterator[int]:
    """A trainer metrics port that accepts connections and never answers (a trainer busy in a long step): each
    pass waits its scrape timeout, so passes of one job follow each other closely; yields the port."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(64)
        yield server.getsockname()[1]


def test_engine_failures_during_spec_edits_are_all_counted(api: KubeApi, operator: KopfRunner, silent_metrics: int):
    api.create(example("tiny-cpu.yaml", "busy", faultTolerance={"maxEngineRestarts": 2 * ROUNDS + 1},
                       gang={"timeoutSeconds": 600}, metrics={"port": silent_metrics}))
    wait_for(lambda: api.get("v1", "Pod", NS, "busy-rollout-1"), "engine pods")
    run_trainer(api, "busy", pod_ip="127.0.0.1")
    wait_for(lambda: job_status(api, "busy").get("phase") == "Running", "phase Running")
    trainer = uid(api.get("batch/v1", "Job", NS, "busy-trainer"))
    for round_ in range(ROUNDS):
        pods = [uid(api.get("v1", "Pod", NS, f"busy-rollout-{i}")) for i in range(2)]
        # One engine fails; the moment a pass has replaced it (and is still writing what it counted), the other
        # fails while the spec is edited: the edit's pass follows at once, beside the timer's.
        fail_pod(api, "busy-rollout-0")
        wait_for(lambda old=pods[0]: uid(api.get("v1", "Pod", NS, "busy-rollout-0")) not in (None, old),
                 f"engine 0 replaced in round {round_}", poll_s=0.005)
        fail_pod(api, "busy-rollout-1")
        patch_spec(api, "busy", {"gang": {"timeoutSeconds": 601 + round_}})
        wait_for(lambda old=pods[1]: uid(api.get("v1", "Pod", NS, "busy-rollout-1")) not in (None, old),
                 f"engine 1 replaced in round {round_}")
    wait_for(lambda: job_status(api, "busy").get("engineRestarts") == 2 * ROUNDS, f"engineRestarts={2 * ROUNDS}")
    time.sleep(2.0)  # a few more passes: a miscount would show as a counter moving on
    status = job_status(api, "busy")
    assert status["engineRestarts"] == 2 * ROUNDS and status["trainerRestarts"] == 0, status
    assert status["phase"] == "Running" and status.get("replacing") == [], status
    assert uid(api.get("batch/v1", "Job", NS, "busy-trainer")) == trainer
    # The budget holds: one more failure than it allows ends the job.
    fail_pod(api, "busy-rollout-0")
    wait_for(lambda: job_status(api, "busy").get("engineRestarts") == 2 * ROUNDS + 1, "the last restart")
    fail_pod(api, "busy-rollout-0")
    fail_pod(api, "busy-rollout-1")
    wait_for(lambda: job_status(api, "busy").get("phase") == "Failed", "phase Failed")
    assert conditions(api, "busy")["Failed"]["reason"] == "EngineRestartsExhausted"
    assert job_status(api, "busy")["engineRestarts"] == 2 * ROUNDS + 1


def test_a_status_write_on_a_stale_version_is_composed_again(api: KubeApi, operator: KopfRunner):
    api.create(example("tiny-cpu.yaml", "stale", rollout={"backend": "reference", "engines": 1,
                                                           "gpusPerEngine": 0}))
    wait_for(lambda: job_status(api, "stale").get("enginesDesired") == 1, "first reconcile")
    old = milesjob(api, "stale")
    # The server refuses a status write conditioned on a version that is no longer stored.
    api.patch(API_VERSION, "MilesJob", NS, "stale", {"metadata": {"labels": {"touched": "yes"}}})
    with pytest.raises(Conflict):
        api.patch(API_VERSION, "MilesJob", NS, "stale", {"metadata": {"resourceVersion":
                                                                      old["metadata"]["resourceVersion"]},
                                                         "status": {"engineRestarts": 99}}, "status")
    # A pass handed that old copy composes its status on the stored one instead: counters are kept.
    api.patch(API_VERSION, "MilesJob", NS, "stale", {"status": {"engineRestarts": 5}}, "status")
    written = Reconciler(api, OperatorConfig()).write_status(
        old, lambda stored: {"engineRestarts": int(stored.get("engineRestarts") or 0) + 1})
    assert written == {"engineRestarts": 6}
    assert job_status(api, "stale")["engineRestarts"] >= 6


def test_deleted_trainer_job_is_a_counted_restart(api: KubeApi, operator: KopfRunner):
    api.create(example("tiny-cpu.yaml", "gone", checkpoint={"volume": {"claimName": "gone-data"}}))
    wait_for(lambda: api.get("batch/v1", "Job", NS, "gone-trainer"), "trainer Job")
    run_trainer(api, "gone", step=3)
    wait_for(lambda: job_status(api, "gone").get("trainerActive") == 1, "trainer active")
    trainer = uid(api.get("batch/v1", "Job", NS, "gone-trainer"))
    api.delete("batch/v1", "Job", NS, "gone-trainer")
    wait_for(lambda: uid(api.get("batch/v1", "Job", NS, "gone-trainer")) not in (None, trainer), "trainer recreated")
    wait_for(lambda: condition_is(api, "gone", "Restarting", "True", "TrainerJobDeleted"), "condition Restarting")
    assert "trainer Job was deleted" in conditions(api, "gone")["Restarting"]["message"]
    time.sleep(1.5)
    status = job_status(api, "gone")
    assert status["trainerRestarts"] == 1 and status["phase"] == "Pending", status


def test_unschedulable_engines_are_named_and_left_out_of_the_engine_list(api: KubeApi, operator: KopfRunner):
    api.create(example("tiny-cpu.yaml", "full"))
    wait_for(lambda: api.get("v1", "Pod", NS, "full-rollout-1"), "engine pods")
    urls = wait_for(lambda: engine_list(api, "full") if len(engine_list(api, "full")) == 2 else None,
                    "engine list")
    why = "0/3 nodes are available: 3 Insufficient cpu."
    api.patch("v1", "Pod", NS, "full-rollout-1", {"status": {"phase": "Pending", "conditions": [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": why}]}}, "status")
    wait_for(lambda: condition_is(api, "full", "EnginesScheduled", "False", "Unschedulable"),
             "condition EnginesScheduled/Unschedulable")
    message = conditions(api, "full")["EnginesScheduled"]["message"]
    assert "full-rollout-1" in message and why in message and "full-rollout-0" not in message, message
    assert conditions(api, "full")["EnginesReady"]["reason"] == "Unschedulable"
    wait_for(lambda: engine_list(api, "full") == urls[:1], "engine list without the unschedulable engine")
    # Scheduled after all (a node freed up): listed again.
    api.patch("v1", "Pod", NS, "full-rollout-1", {"status": {"conditions": [
        {"type": "PodScheduled", "status": "True"}]}}, "status")
    wait_for(lambda: engine_list(api, "full") == urls, "engine list with both engines")
    wait_for(lambda: condition_is(api, "full", "EnginesScheduled", "True", "Scheduled"), "condition EnginesScheduled")


def test_a_milesjob_being_deleted_reads_terminating(api: KubeApi, operator: KopfRunner):
    api.create(example("tiny-cpu.yaml", "bye"))
    run = wait_for(lambda: api.get("batch/v1", "Job", NS, "bye-trainer"), "trainer Job")
    assert run is not None
    run_trainer(api, "bye", step=2)
    wait_for(lambda: job_status(api, "bye").get("phase") == "Running", "phase Running")
    # A finalizer of someone else's holds the object after the operator let go (as foreground deletion
    # holds it while the garbage collector deletes its children).
    api.patch(API_VERSION, "MilesJob", NS, "bye", {"metadata": {"finalizers": [
        *milesjob(api, "bye")["metadata"].get("finalizers", []), "example.com/hold"]}})
    api.delete(API_VERSION, "MilesJob", NS, "bye")
    wait_for(lambda: job_status(api, "bye").get("phase") == "Terminating", "phase Terminating")
    assert condition_is(api, "bye", "Terminating", "True", "DeletionRequested")
    wait_for(lambda: milesjob(api, "bye")["metadata"]["finalizers"] == ["example.com/hold"], "the operator let go")
    assert job_status(api, "bye")["phase"] == "Terminating"
    api.patch(API_VERSION, "MilesJob", NS, "bye", {"metadata": {"finalizers": None}})
    wait_for(lambda: api.get(API_VERSION, "MilesJob", NS, "bye") is None, "MilesJob gone")
