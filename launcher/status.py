"""MilesJob status: the phase state machine, Kubernetes-style conditions, and training progress.

Phases: Pending -> Running -> Succeeded | Failed. Running may fall back to Pending while the trainer
restarts from a checkpoint; Succeeded and Failed are terminal (a finished job never changes again).

Progress (`status.step`, `status.lastCheckpoint`) comes from trainer pod 0, first source that answers:
  1. its annotations `mileslite.dev/step` and `mileslite.dev/last-checkpoint` (anything may set them:
     the trainer, a sidecar, an operator of the cluster);
  2. its Prometheus endpoint `http://<podIP>:<spec.metrics.port>/metrics`, gauges `miles_lite_step` and
     `miles_lite_checkpoint_step` (names configurable in `OperatorConfig`).
"""

from __future__ import annotations

import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from launcher.spec import GROUP

PENDING, RUNNING, SUCCEEDED, FAILED = "Pending", "Running", "Succeeded", "Failed"
PHASES = (PENDING, RUNNING, SUCCEEDED, FAILED)
TERMINAL = (SUCCEEDED, FAILED)
ALLOWED: dict[str, frozenset[str]] = {
    PENDING: frozenset(PHASES),
    RUNNING: frozenset(PHASES),
    SUCCEEDED: frozenset({SUCCEEDED}),
    FAILED: frozenset({FAILED}),
}
STEP_ANNOTATION = f"{GROUP}/step"
CHECKPOINT_ANNOTATION = f"{GROUP}/last-checkpoint"

# Condition types written by the operator.
READY_OBJECTS = "ObjectsApplied"
TRAINER_READY = "TrainerReady"
ENGINES_READY = "EnginesReady"
GANG_SCHEDULED = "GangScheduled"
COMPLETE = "Complete"
FAILED_CONDITION = "Failed"


class InvalidTransition(RuntimeError):
    """A phase change the state machine forbids (e.g. leaving a terminal phase)."""


def transition(current: str | None, target: str) -> str:
    """Validate `current -> target` (None = a new job) and return `target`."""
    if target not in PHASES:
        raise InvalidTransition(f"unknown phase {target!r}; phases are {PHASES}")
    if current is not None and target not in ALLOWED[current]:
        raise InvalidTransition(f"MilesJob phase {current} cannot become {target}")
    return target


@dataclass(frozen=True)
class Observation:
    """What the reconciler saw of a job's children in one pass (counts are pods)."""

    spec_error: str | None = None
    trainer_replicas: int = 1
    trainer_active: int = 0
    trainer_complete: bool = False
    # The trainer failed and its restart budget is spent.
    trainer_exhausted: bool = False
    trainer_restarting: bool = False
    engines_desired: int = 0
    engines_ready: int = 0
    engines_alive: int = 0
    # Engines died and their replacement budget is spent.
    engines_exhausted: bool = False


def decide_phase(obs: Observation) -> tuple[str, str, str]:
    """The phase an observation implies, with a reason and a human message: (phase, reason, message)."""
    if obs.spec_error:
        return FAILED, "InvalidSpec", obs.spec_error
    if obs.trainer_complete:
        return SUCCEEDED, "TrainerCompleted", "trainer pod 0 exited successfully"
    if obs.trainer_exhausted:
        return FAILED, "TrainerRestartsExhausted", "the trainer failed; spec.faultTolerance.maxTrainerRestarts is spent"
    if obs.engines_exhausted and obs.engines_alive == 0:
        return FAILED, "EngineRestartsExhausted", "no engine left; spec.faultTolerance.maxEngineRestarts is spent"
    if obs.trainer_restarting:
        return PENDING, "TrainerRestarting", "the trainer failed; restarting from the newest checkpoint"
    if obs.trainer_active >= obs.trainer_replicas:
        return RUNNING, "TrainerRunning", f"{obs.engines_ready}/{obs.engines_desired} engines ready"
    return PENDING, "Starting", f"trainer {obs.trainer_active}/{obs.trainer_replicas} pods active, " \
                                f"{obs.engines_ready}/{obs.engines_desired} engines ready"


def set_condition(conditions: list[dict[str, Any]], type_: str, status: bool, reason: str, message: str,
                  now: str, generation: int) -> list[dict[str, Any]]:
    """A copy of `conditions` with `type_` set; `lastTransitionTime` (RFC 3339 `now`) moves only when status flips."""
    value = "True" if status else "False"
    out = [dict(c) for c in conditions if c.get("type") != type_]
    old = next((c for c in conditions if c.get("type") == type_), None)
    since = old["lastTransitionTime"] if old and old.get("status") == value and old.get("lastTransitionTime") else now
    out.append({"type": type_, "status": value, "reason": reason, "message": message,
                "lastTransitionTime": since, "observedGeneration": generation})
    return sorted(out, key=lambda c: c["type"])


def parse_metrics(text: str, step_metric: str, checkpoint_metric: str) -> tuple[int | None, str | None]:
    """Prometheus text exposition -> (step, last checkpoint step as a string); None where a gauge is absent."""
    step: int | None = None
    ckpt: str | None = None
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == step_metric:
                step = int(sample.value)
            elif sample.name == checkpoint_metric and sample.value >= 0:
                ckpt = str(int(sample.value))
    return step, ckpt


def scrape(url: str, timeout_s: float) -> str:
    """GET a metrics endpoint (http URL) and return its text; raises OSError when it does not answer."""
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:  # noqa: S310 - cluster-internal http URL
        return resp.read().decode("utf-8", "replace")


def _int_or_none(value: object) -> int | None:
    try:
        return int(str(value))
    except (TypeError, ValueError):
        return None


def trainer_progress(pod: Mapping[str, Any] | None, metrics_port: int, step_metric: str, checkpoint_metric: str,
                     timeout_s: float = 1.0) -> tuple[int | None, str | None]:
    """(step, last checkpoint) reported by trainer pod 0: annotations first, then its metrics endpoint."""
    if not pod:
        return None, None
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    step = _int_or_none(annotations.get(STEP_ANNOTATION))
    ckpt = annotations.get(CHECKPOINT_ANNOTATION)
    if step is not None:
        return step, ckpt
    status = pod.get("status") or {}
    ip = status.get("podIP")
    if status.get("phase") != "Running" or not ip:
        return None, ckpt
    try:
        text = scrape(f"http://{ip}:{metrics_port}/metrics", timeout_s)
    except OSError:
        # Not serving yet (or restarting): progress stays as last reported.
        return None, ckpt
    m_step, m_ckpt = parse_metrics(text, step_metric, checkpoint_metric)
    return m_step, ckpt or m_ckpt
