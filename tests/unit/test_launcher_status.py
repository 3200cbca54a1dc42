"""MilesJob status logic: the phase state machine, conditions, and progress from annotations or /metrics."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Gauge, generate_latest, start_http_server

from launcher import status as st
from launcher.reconcile import _index_done


def test_terminal_phases_never_change():
    for terminal in st.TERMINAL:
        assert st.transition(terminal, terminal) == terminal
        # Only a deletion request moves a finished job (to Terminating, which nothing leaves).
        for other in set(st.PHASES) - {terminal, st.TERMINATING}:
            with pytest.raises(st.InvalidTransition, match=f"{terminal} cannot become {other}"):
                st.transition(terminal, other)
        assert st.transition(terminal, st.TERMINATING) == st.TERMINATING
    for phase in (st.PENDING, st.RUNNING):
        assert st.transition(phase, st.TERMINATING) == st.TERMINATING
    assert st.transition(None, st.PENDING) == st.PENDING
    assert st.transition(st.RUNNING, st.PENDING) == st.PENDING  # trainer restarting
    with pytest.raises(st.InvalidTransition, match="unknown phase"):
        st.transition(st.PENDING, "Restarting")


@pytest.mark.parametrize(("obs", "phase", "reason"), [
    (st.Observation(spec_error="spec.x: bad"), st.FAILED, "InvalidSpec"),
    (st.Observation(trainer_complete=True, trainer_exhausted=True), st.SUCCEEDED, "TrainerCompleted"),
    (st.Observation(trainer_exhausted=True), st.FAILED, "TrainerRestartsExhausted"),
    (st.Observation(engines_exhausted=True, engines_alive=0, trainer_active=1), st.FAILED, "EngineRestartsExhausted"),
    (st.Observation(engines_exhausted=True, engines_alive=1, trainer_active=1), st.RUNNING, "TrainerRunning"),
    (st.Observation(trainer_restarting=True, trainer_active=1), st.PENDING, "TrainerRestarting"),
    (st.Observation(trainer_replicas=2, trainer_active=1), st.PENDING, "Starting"),
    (st.Observation(trainer_replicas=2, trainer_active=2), st.RUNNING, "TrainerRunning"),
])
def test_decide_phase(obs, phase, reason):
    assert st.decide_phase(obs)[:2] == (phase, reason)


def test_condition_transition_time_moves_only_on_flips():
    c = st.set_condition([], "EnginesReady", False, "Starting", "0/2", "2026-01-01T00:00:00Z", 1)
    c = st.set_condition(c, "EnginesReady", False, "Starting", "1/2", "2026-01-01T00:00:05Z", 1)
    assert c == [{"type": "EnginesReady", "status": "False", "reason": "Starting", "message": "1/2",
                  "lastTransitionTime": "2026-01-01T00:00:00Z", "observedGeneration": 1}]
    c = st.set_condition(c, "EnginesReady", True, "Ready", "2/2", "2026-01-01T00:00:09Z", 2)
    c = st.set_condition(c, "Complete", False, "Running", "", "2026-01-01T00:00:09Z", 2)
    assert [x["type"] for x in c] == ["Complete", "EnginesReady"]
    assert c[1]["lastTransitionTime"] == "2026-01-01T00:00:09Z" and c[1]["status"] == "True"


def _registry(step: float, ckpt: float) -> CollectorRegistry:
    reg = CollectorRegistry()
    Gauge("miles_lite_step", "optimizer step", registry=reg).set(step)
    Gauge("miles_lite_checkpoint_step", "step of the newest checkpoint", registry=reg).set(ckpt)
    Gauge("miles_other", "unrelated", registry=reg).set(99)
    return reg


def test_parse_metrics_reads_the_named_gauges():
    text = generate_latest(_registry(12, 10)).decode()
    assert st.parse_metrics(text, "miles_lite_step", "miles_lite_checkpoint_step") == (12, "10")
    assert st.parse_metrics(generate_latest(_registry(3, -1)).decode(), "miles_lite_step",
                            "miles_lite_checkpoint_step") == (3, None)
    assert st.parse_metrics("", "miles_lite_step", "miles_lite_checkpoint_step") == (None, None)


def test_progress_annotations_win_over_metrics():
    pod = {"metadata": {"annotations": {st.STEP_ANNOTATION: "7", st.CHECKPOINT_ANNOTATION: "/ckpt/step_5"}},
           "status": {"phase": "Running", "podIP": "127.0.0.1"}}
    assert st.trainer_progress(pod, 1, "miles_lite_step", "miles_lite_checkpoint_step") == (7, "/ckpt/step_5", None)
    assert st.trainer_progress(None, 1, "a", "b") == (None, None, None)
    pending = {"metadata": {}, "status": {"phase": "Pending"}}
    assert st.trainer_progress(pending, 1, "a", "b") == (None, None, None)


def test_progress_scraped_from_a_real_metrics_endpoint():
    server, thread = start_http_server(0, addr="127.0.0.1", registry=_registry(42, 40))
    try:
        port = server.server_address[1]
        pod = {"metadata": {"annotations": {}}, "status": {"phase": "Running", "podIP": "127.0.0.1"}}
        assert st.trainer_progress(pod, port, "miles_lite_step", "miles_lite_checkpoint_step") == (42, "40", None)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
    # The endpoint is gone: progress is unknown, not an error.
    assert st.trainer_progress(pod, port, "miles_lite_step", "miles_lite_checkpoint_step", 0.5) == (None, None, None)


@pytest.mark.parametrize(("answer", "problem"), [
    ("miles_lite_step NaN\n", "miles_lite_step is nan, not a finite number"),
    ("<html><body>502 Bad Gateway</body></html>", "the answer is not Prometheus text"),
    ("miles_lite_checkpoint_step +Inf\nmiles_lite_step 3\n", "miles_lite_checkpoint_step is inf"),
])
def test_unreadable_metrics_answer_is_a_problem_not_an_exception(answer, problem):
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the stdlib's name
            body = answer.encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            return

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        pod = {"metadata": {"annotations": {}}, "status": {"phase": "Running", "podIP": "127.0.0.1"}}
        progress = st.trainer_progress(pod, server.server_address[1], "miles_lite_step", "miles_lite_checkpoint_step")
        assert progress.step is None and problem in progress.problem, progress
        assert f"127.0.0.1:{server.server_address[1]}/metrics" in progress.problem
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def test_failed_for_invalid_spec_reopens_on_a_new_generation():
    failed = {"phase": "Failed", "conditions": [{"type": "Failed", "status": "True", "reason": "InvalidSpec",
                                                "observedGeneration": 2}]}
    assert not st.reopens(failed, 2) and st.reopens(failed, 3)
    budget = {"phase": "Failed", "conditions": [{"type": "Failed", "status": "True",
                                                "reason": "TrainerRestartsExhausted", "observedGeneration": 2}]}
    assert not st.reopens(budget, 3)
    assert st.transition("Failed", "Pending", reopened=True) == "Pending"
    with pytest.raises(st.InvalidTransition):
        st.transition("Failed", "Pending")


@pytest.mark.parametrize(("completed", "index", "done"), [
    (None, 0, False), ("", 0, False), ("0", 0, True), ("1-3", 0, False), ("0-2,5", 2, True), ("1,3-4", 4, True),
    ("10", 0, False),
])
def test_completed_indexes(completed, index, done):
    assert _index_done(completed, index) is done
