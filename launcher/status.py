"""MilesJob status: the phase state machine, Kubernetes-style conditions, and training progress.

Phases: Pending -> Running -> Succeeded | Failed. Running may fall back to Pending while the trainer
restarts from a checkpoint; Succeeded and Failed are terminal, with one exit: a job Failed for an invalid
spec before anything ran (condition Failed, reason InvalidSpec) is reopened as Pending by a new spec.
Any phase becomes Terminating once the MilesJob's deletion is requested (it ends there: the object goes).

Progress (`status.step`, `status.lastCheckpoint`) comes from trainer pod 0, first source that answers:
  1. its annotations `mileslite.dev/step` and `mileslite.dev/last-checkpoint` (anything may set them:
     the trainer, a sidecar, an operator of the cluster);
  2. its Prometheus endpoint `http://<podIP>:<spec.metrics.port>/metrics`, gauges `miles_lite_step` and
     `miles_lite_checkpoint_step` (names configurable in `OperatorConfig`).
"""

from __future__ import annotations

import math
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from prometheus_client.parser import text_string_to_metric_families

from launcher.spec import GROUP

PENDING, RUNNING, SUCCEEDED, FAILED = "Pending", "Running", "Succeeded", "Failed"
TERMINATING = "Terminating"
PHASES = (PENDING, RUNNING, SUCCEEDED, FAILED, TERMINATING)
TERMINAL = (SUCCEEDED, FAILED, TERMINATING)
ALLOWED: dict[str, frozenset[str]] = {
    PENDING: frozenset(PHASES),
    RUNNING: frozenset(PHASES),
    SUCCEEDED: frozenset({SUCCEEDED, TERMINATING}),
    FAILED: frozenset({FAILED, TERMINATING}),
    TERMINATING: frozenset({TERMINATING}),
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
# Engines being added or removed after an edit of spec.rollout.engines.
SCALING = "Scaling"
# The trainer is being restarted from its newest checkpoint (it failed, its Job vanished, or an edit needs it);
# the reason says which.
RESTARTING = "Restarting"
RESTART_TRAINER_FAILED = "TrainerFailed"
RESTART_TRAINER_GONE = "TrainerJobDeleted"
RESTART_SPEC_CHANGED = "SpecChanged"
# Every engine pod has a node, or (False, reason Unschedulable) the ones that cannot get one.
ENGINES_SCHEDULED = "EnginesScheduled"
# The MilesJob's deletion was requested (phase Terminating).
TERMINATING_CONDITION = "Terminating"
# The newest spec is not applied (invalid, refused by the API server, or an edit that would lose progress).
INVALID_SPEC = "InvalidSpec"
# Trainer pod 0's progress could be read (False with the reason when its metrics answer is unreadable).
PROGRESS_REPORTED = "ProgressReported"
# The last reconcile pass completed (False with the error when it did not; what it did is still saved).
RECONCILED = "Reconciled"
INVALID_SPEC_REASON = "InvalidSpec"


class InvalidTransition(RuntimeError):
    """A phase change the state machine forbids (e.g. leaving a terminal phase)."""


def transition(current: str | None, target: str, reopened: bool = False) -> str:
    """Validate `current -> target` (None = a new job) and return `target`. `reopened`: a job Failed for an
    invalid spec got a new spec (see `reopens`), which may start it again."""
    if target not in PHASES:
        raise InvalidTransition(f"unknown phase {target!r}; phases are {PHASES}")
    if reopened and current == FAILED:
        return target
    if current is not None and target not in ALLOWED[current]:
        raise InvalidTransition(f"MilesJob phase {current} cannot become {target}")
    return target


def reopens(status: Mapping[str, Any], generation: int) -> bool:
    """Whether a Failed job may start again: it failed for an invalid spec and the spec has changed since."""
    if status.get("phase") != FAILED:
        return False
    failed = next((c for c in status.get("conditions") or [] if c.get("type") == FAILED_CONDITION), None)
    return (failed is not None and failed.get("reason") == INVALID_SPEC_REASON
            and int(failed.get("observedGeneration") or 0) < generation)


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
    # Why the trainer Job was replaced in this pass: TrainerFailed, TrainerJobDeleted or SpecChanged (None: not
    # replaced now).
    restart_reason: str | None = None
    engines_desired: int = 0
    engines_ready: int = 0
    engines_alive: int = 0
    # Engines died and their replacement budget is spent.
    engines_exhausted: bool = False
    # Engine pods the scheduler cannot place (PodScheduled False, reason Unschedulable), and its message.
    engines_unschedulable: tuple[str, ...] = ()
    unschedulable_message: str = ""


def decide_phase(obs: Observation) -> tuple[str, str, str]:
    """The phase an observation implies, with a reason and a human message: (phase, reason, message)."""
    if obs.spec_error:
        return FAILED, INVALID_SPEC_REASON, obs.spec_error
    if obs.trainer_complete:
        return SUCCEEDED, "TrainerCompleted", "trainer pod 0 exited successfully"
    if obs.trainer_exhausted:
        return FAILED, "TrainerRestartsExhausted", "the trainer failed; spec.faultTolerance.maxTrainerRestarts is spent"
    if obs.engines_exhausted and obs.engines_alive == 0:
        return FAILED, "EngineRestartsExhausted", "no engine left; spec.faultTolerance.maxEngineRestarts is spent"
    if obs.trainer_restarting:
        why = {RESTART_SPEC_CHANGED: "an applied edit replaces the trainer",
               RESTART_TRAINER_GONE: "the trainer Job was deleted"}.get(obs.restart_reason or "", "the trainer failed")
        return PENDING, "TrainerRestarting", f"{why}; restarting from the newest checkpoint"
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


class MetricsError(ValueError):
    """A metrics answer that is not Prometheus text, or whose progress gauges are not finite numbers."""


def parse_metrics(text: str, step_metric: str, checkpoint_metric: str) -> tuple[int | None, str | None]:
    """Prometheus text exposition -> (step, last checkpoint step as a string); None where a gauge is absent.
    Raises MetricsError for an answer that is not Prometheus text or a gauge that is not a finite number."""
    step: int | None = None
    ckpt: str | None = None
    try:
        samples = [s for family in text_string_to_metric_families(text) for s in family.samples]
    except (ValueError, TypeError, IndexError, KeyError) as err:
        first = text.strip().splitlines()[0][:80] if text.strip() else ""
        raise MetricsError(f"the answer is not Prometheus text ({err}; it begins {first!r})") from err
    for sample in samples:
        if sample.name not in (step_metric, checkpoint_metric):
            continue
        if not math.isfinite(sample.value):
            raise MetricsError(f"{sample.name} is {sample.value}, not a finite number")
        if sample.name == step_metric:
            step = int(sample.value)
        elif sample.value >= 0:
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


class Progress(NamedTuple):
    """What trainer pod 0 reports: step, last checkpoint, and why its metrics could not be read (or None)."""

    step: int | None
    checkpoint: str | None
    problem: str | None = None


def trainer_progress(pod: Mapping[str, Any] | None, metrics_port: int, step_metric: str, checkpoint_metric: str,
                     timeout_s: float = 1.0) -> Progress:
    """Progress reported by trainer pod 0: annotations first, then its metrics endpoint. Never raises for what
    the pod answers: an unreadable answer is returned as `problem`."""
    if not pod:
        return Progress(None, None)
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    step = _int_or_none(annotations.get(STEP_ANNOTATION))
    ckpt = annotations.get(CHECKPOINT_ANNOTATION)
    if step is not None:
        return Progress(step, ckpt)
    status = pod.get("status") or {}
    ip = status.get("podIP")
    if status.get("phase") != "Running" or not ip:
        return Progress(None, ckpt)
    url = f"http://{ip}:{metrics_port}/metrics"
    try:
        text = scrape(url, timeout_s)
    except (OSError, ValueError):
        # Not serving yet (or restarting): progress stays as last reported.
        return Progress(None, ckpt)
    try:
        m_step, m_ckpt = parse_metrics(text, step_metric, checkpoint_metric)
    except MetricsError as err:
        return Progress(None, ckpt, f"{url}: {err}")
    return Progress(m_step, ckpt or m_ckpt)
