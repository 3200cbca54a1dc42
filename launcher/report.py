"""The status a reconcile pass writes: phase, conditions, counts and progress, composed from what the pass saw
and did (`PassResult`) on top of the status as stored when it is written.

Composing on the stored status (not on the copy read at the start of the pass) is what makes the write safe:
`launcher.reconcile.write_status` writes under the job's lock with the stored resourceVersion as a
precondition, and on a conflict composes again on the newer status. Counters are deltas added to the stored
values, so a restart or an engine replacement counted by a pass is never lost nor counted twice.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from launcher import status as st
from launcher.changes import Change


@dataclass
class PassResult:
    """What one pass saw and did: the observation, progress, counter deltas, and the edit it applied or refused."""

    obs: st.Observation
    progress: st.Progress
    generation: int
    reopened: bool
    gang_timeout_s: int | None = None
    trainer_restarts: int = 0
    engine_restarts: int = 0
    # Engine pods the operator deleted on purpose and recreates (their disappearance is not a loss).
    replacing: tuple[str, ...] | None = None
    # Why the newest spec is not applied (InvalidSpec reason, message), or the edit applied now.
    refusal: tuple[str, str] | None = None
    change: Change | None = None
    has_desired: bool = True
    # Extra conditions to set: (type, status, reason, message).
    extra: list[tuple[str, bool, str, str]] = field(default_factory=list)


def counters(stored: Mapping[str, Any], trainer_restarts: int, engine_restarts: int,
             replacing: tuple[str, ...] | None) -> dict[str, Any]:
    """The stored restart counters plus a pass's increments (and its list of engine pods being replaced)."""
    out: dict[str, Any] = {"trainerRestarts": int(stored.get("trainerRestarts") or 0) + trainer_restarts,
                           "engineRestarts": int(stored.get("engineRestarts") or 0) + engine_restarts}
    if replacing is not None:
        out["replacing"] = sorted(replacing)
    return out


def compose(stored: Mapping[str, Any], result: PassResult, now: str) -> dict[str, Any]:
    """The status patch for `result` on top of `stored` (the status as the API server holds it now); empty when
    the stored job ended meanwhile (another writer finished it: nothing to add)."""
    phase = stored.get("phase")
    if phase in st.TERMINAL and not st.reopens(stored, result.generation) and not result.reopened:
        return {}
    patch = _status(phase, result, stored, now)
    patch.update(counters(stored, result.trainer_restarts, result.engine_restarts, result.replacing))
    return patch


def _status(phase: str | None, result: PassResult, status: Mapping[str, Any], now: str) -> dict[str, Any]:
    obs, generation, progress = result.obs, result.generation, result.progress
    conditions = list(status.get("conditions") or [])
    new_phase, reason, message = st.decide_phase(obs)
    st.transition(phase, new_phase, reopened=result.reopened)
    start = status.get("startTime") or now
    c = st.set_condition(conditions, st.TRAINER_READY, obs.trainer_active >= obs.trainer_replicas,
                         "TrainerRestarting" if obs.trainer_restarting else "Active",
                         f"{obs.trainer_active}/{obs.trainer_replicas} trainer pods active", now, generation)
    c = st.set_condition(c, st.ENGINES_READY, obs.engines_desired > 0 and obs.engines_ready >= obs.engines_desired,
                         "EnginesExhausted" if obs.engines_exhausted else
                         ("Unschedulable" if obs.engines_unschedulable else "Ready"),
                         f"{obs.engines_ready}/{obs.engines_desired} engines ready", now, generation)
    if obs.engines_unschedulable:
        names = ", ".join(obs.engines_unschedulable)
        why = obs.unschedulable_message or "the scheduler gives no reason"
        c = st.set_condition(c, st.ENGINES_SCHEDULED, False, "Unschedulable",
                             f"engine pods {names} cannot be scheduled ({why}); the trainer's engine list leaves "
                             "them out until they are scheduled", now, generation)
    elif obs.engines_desired > 0:
        c = st.set_condition(c, st.ENGINES_SCHEDULED, True, "Scheduled",
                             f"no engine pod is waiting for a node ({obs.engines_desired} desired)", now, generation)
    started = obs.trainer_active >= obs.trainer_replicas
    timeout = _timed_out(start, now, result.gang_timeout_s)
    c = st.set_condition(c, st.GANG_SCHEDULED, started, "Started" if started else
                         ("Timeout" if timeout else "Waiting"),
                         "trainer gang started" if started else "waiting for the trainer gang to start", now,
                         generation)
    if result.has_desired:
        c = _edit_conditions(c, obs, status, result, now, generation)
    c = st.set_condition(c, st.RECONCILED, True, "Reconciled", "the last pass completed", now, generation)
    if progress.problem:
        c = st.set_condition(c, st.PROGRESS_REPORTED, False, "MetricsUnreadable", progress.problem, now, generation)
    elif progress.step is not None:
        c = st.set_condition(c, st.PROGRESS_REPORTED, True, "Reported", f"step {progress.step}", now, generation)
    if new_phase == st.SUCCEEDED:
        c = st.set_condition(c, st.COMPLETE, True, reason, message, now, generation)
    if new_phase == st.FAILED:
        c = st.set_condition(c, st.FAILED_CONDITION, True, reason, message, now, generation)
    elif result.reopened:
        c = st.set_condition(c, st.FAILED_CONDITION, False, "SpecChanged",
                             f"generation {generation} is valid; the job starts again", now, generation)
    for type_, value, why, text in result.extra:
        c = st.set_condition(c, type_, value, why, text, now, generation)
    patch: dict[str, Any] = {
        "phase": new_phase, "message": message, "observedGeneration": generation, "conditions": c,
        "startTime": start, "enginesReady": obs.engines_ready, "enginesDesired": obs.engines_desired,
        "engines": f"{obs.engines_ready}/{obs.engines_desired}", "trainerActive": obs.trainer_active,
    }
    if progress.step is not None:
        patch["step"] = progress.step
    if progress.checkpoint is not None:
        patch["lastCheckpoint"] = progress.checkpoint
    if new_phase in st.TERMINAL:
        patch["completionTime"] = now
    elif result.reopened:
        patch["completionTime"] = None
    if result.refusal is not None:
        patch["message"] = f"{message}; the newest spec is not applied: {result.refusal[1]}"
    return patch


def _edit_conditions(c: list[dict[str, Any]], obs: st.Observation, status: Mapping[str, Any], result: PassResult,
                     now: str, generation: int) -> list[dict[str, Any]]:
    """InvalidSpec, Scaling and Restarting: whether the newest spec is applied and what applying it does."""
    if result.refusal is not None:
        c = st.set_condition(c, st.INVALID_SPEC, True, result.refusal[0], result.refusal[1], now, generation)
    else:
        c = st.set_condition(c, st.INVALID_SPEC, False, "Applied", f"generation {generation} is applied", now,
                             generation)
    old = {x["type"]: x for x in status.get("conditions") or []}
    prev_desired = status.get("enginesDesired")
    settled = obs.engines_ready == obs.engines_desired
    if prev_desired is not None and int(prev_desired) != obs.engines_desired:
        verb = "adding" if obs.engines_desired > int(prev_desired) else "removing"
        c = st.set_condition(c, st.SCALING, True, "ScaleUp" if verb == "adding" else "ScaleDown",
                             f"rollout engines {prev_desired} -> {obs.engines_desired}: {verb} engine pods; the "
                             "trainer keeps running and its fleet follows the engine list", now, generation)
    elif old.get(st.SCALING, {}).get("status") == "True" and not settled:
        c = [x if x["type"] != st.SCALING else {**old[st.SCALING], "observedGeneration": generation} for x in c]
    else:
        c = st.set_condition(c, st.SCALING, False, "Stable", f"{obs.engines_ready}/{obs.engines_desired} engines "
                             "ready", now, generation)
    if obs.trainer_restarting:
        change = result.change
        why = {st.RESTART_SPEC_CHANGED: f"applying {change.describe() if change else 'the new spec'}: ",
               st.RESTART_TRAINER_FAILED: "the trainer failed (its pod exited with an error, was killed or lost "
                                          "its node): ",
               st.RESTART_TRAINER_GONE: "the trainer Job was deleted while the job ran: "}.get(
            obs.restart_reason or "", "")
        reason = obs.restart_reason or old.get(st.RESTARTING, {}).get("reason") or "TrainerRestarting"
        c = st.set_condition(c, st.RESTARTING, True, reason, f"{why}the trainer restarts from its newest checkpoint",
                             now, generation)
    elif old.get(st.RESTARTING, {}).get("status") == "True" and obs.trainer_active < obs.trainer_replicas:
        c = [x if x["type"] != st.RESTARTING else {**old[st.RESTARTING], "observedGeneration": generation}
             for x in c]
    else:
        c = st.set_condition(c, st.RESTARTING, False, "Running", "no trainer restart in progress", now, generation)
    return c


def terminating(stored: Mapping[str, Any], now: str, generation: int) -> dict[str, Any]:
    """The status of a MilesJob whose deletion was requested: phase Terminating, condition Terminating."""
    if stored.get("phase") == st.TERMINATING:
        return {}
    message = "the MilesJob is being deleted: its trainer Job, engine pods and other objects go with it"
    c = st.set_condition(list(stored.get("conditions") or []), st.TERMINATING_CONDITION, True,
                         "DeletionRequested", message, now, generation)
    return {"phase": st.transition(stored.get("phase"), st.TERMINATING), "message": message, "conditions": c}


def _timed_out(start: str, now: str, timeout_s: int | None) -> bool:
    if timeout_s is None:
        return False
    try:
        waited = (datetime.fromisoformat(now.replace("Z", "+00:00"))
                  - datetime.fromisoformat(start.replace("Z", "+00:00"))).total_seconds()
    except ValueError:
        return False
    return waited > timeout_s
