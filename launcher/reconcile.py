"""One reconciliation pass of a MilesJob: apply its newest valid spec, heal, report.

- Which spec: the newest when it parses, the API server accepts its objects (server-side dry run) and, on
  a running job, the edit does not throw away the trainer's progress (launcher/changes.py); otherwise the
  spec applied before (recorded in the ConfigMap) with condition InvalidSpec saying why. A job whose spec
  was never applied is Failed (reason InvalidSpec) with nothing left running; a new spec reopens it.
- Supporting objects (ConfigMap, Services, PodGroups) are created when missing and merge-patched when
  their spec hash differs.
- The trainer Job: created when missing; replaced when its template changed (condition Restarting); when it
  failed, deleted and recreated (its command resumes from the newest checkpoint: checkpoint.resume=auto),
  counted in `status.trainerRestarts` up to spec.faultTolerance.maxTrainerRestarts. Trainer pod 0 completing
  = success. Scaling the engines never touches it (condition Scaling).
- Engine pods: a pod that failed, exited or vanished is replaced without touching the trainer, counted in
  `status.engineRestarts` up to maxEngineRestarts; pods beyond spec.rollout.engines are deleted.
- Status: phase (status.py's state machine), conditions, engine counts, step and last checkpoint. The
  counters are returned whatever fails later in a pass (condition Reconciled False names the failure).
A finished job (Succeeded or Failed) stops its engines and the trainer's remaining workers.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

from launcher import status as st
from launcher.changes import Change, EditRefused, applied_spec, check_restart, classify
from launcher.kube import Conflict, KubeApi, Refused
from launcher.render import HASH_ANNOTATION, JOB_LABEL, ROLE_LABEL, key_secret_metadata, render_job, selector
from launcher.security import ensure_key_secret
from launcher.spec import API_VERSION, KIND, JobSpec, SpecError, gpu_variant, parse_job, uses_gpus

COMPLETION_INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"


@dataclass(frozen=True)
class OperatorConfig:
    """Operator knobs: reconcile cadence (seconds) and where trainer progress is read from."""

    interval_s: float = 10.0
    # Image given to jobs without spec.image (the GPU variant, NAME:TAG-gpu, to jobs with GPUs); None: none.
    job_image: str | None = None
    step_metric: str = "miles_lite_step"
    checkpoint_metric: str = "miles_lite_checkpoint_step"
    scrape_timeout_s: float = 1.0


def _hash(obj: Mapping[str, Any] | None) -> str | None:
    return ((obj or {}).get("metadata") or {}).get("annotations", {}).get(HASH_ANNOTATION)


def _meta(obj: Mapping[str, Any]) -> tuple[str, str, str, str]:
    m = obj["metadata"]
    return obj["apiVersion"], obj["kind"], m["namespace"], m["name"]


def apply_object(api: KubeApi, obj: Mapping[str, Any]) -> str:
    """Create `obj`, or merge-patch it when its spec hash changed; returns created | patched | unchanged."""
    live = api.get(*_meta(obj))
    if live is None:
        try:
            api.create(obj)
            return "created"
        except Conflict:
            return "unchanged"
    if _hash(live) == _hash(obj):
        return "unchanged"
    api.patch(*_meta(obj), {k: v for k, v in obj.items() if k not in ("apiVersion", "kind")})
    return "patched"


def _index_done(completed: str | None, index: int) -> bool:
    """Whether `index` is in a Job's completedIndexes string ("0-2,5")."""
    for part in (completed or "").split(","):
        lo, _, hi = part.partition("-")
        if lo.strip() and int(lo) <= index <= int(hi or lo):
            return True
    return False


def _condition(obj: Mapping[str, Any], type_: str) -> bool:
    return any(c.get("type") == type_ and c.get("status") == "True"
               for c in (obj.get("status") or {}).get("conditions") or [])


def _gone(obj: Mapping[str, Any]) -> bool:
    return bool(obj["metadata"].get("deletionTimestamp"))


def _parallelism(job: Mapping[str, Any]) -> int | None:
    return (job.get("spec") or {}).get("parallelism")


@dataclass
class _Counts:
    trainer_restarts: int
    engine_restarts: int


@dataclass(frozen=True)
class _Desired:
    """What a pass makes the cluster match: the applied spec's job and objects, and why a newer spec is not
    applied (InvalidSpec reason and message), or the edit being applied now."""

    job: JobSpec
    objs: list[dict[str, Any]]
    refusal: tuple[str, str] | None = None
    change: Change | None = None


# Kinds that a server-side dry run checks before a new spec is applied (PodGroup CRDs may be absent).
_DRY_RUN_KINDS = ("ConfigMap", "Service", "Job", "Pod")


class Reconciler:
    """Reconciles MilesJobs through a KubeApi; one instance per operator process."""

    def __init__(self, api: KubeApi, config: OperatorConfig, logger: logging.Logger | None = None):
        self.api = api
        self.config = config
        self.log = logger or logging.getLogger("launcher")

    def stamp_image(self, body: Mapping[str, Any]) -> Mapping[str, Any]:
        """Write the operator's default image into a job without spec.image, once: later operator upgrades
        leave running jobs' pods alone. Returns the body as stored after the write."""
        spec = body.get("spec") or {}
        if spec.get("image") or not self.config.job_image:
            return body
        try:
            image = gpu_variant(self.config.job_image) if uses_gpus(spec) else self.config.job_image
        except ValueError as err:
            raise SpecError([f"spec.image: unset, and {err}"]) from err
        m = body["metadata"]
        stored = self.api.patch(API_VERSION, KIND, m["namespace"], m["name"], {"spec": {"image": image}})
        self.log.info("%s/%s: spec.image set to the operator's default %s", m["namespace"], m["name"], image)
        return stored

    # ---- which spec a pass applies ----
    def _dry_run(self, objs: list[dict[str, Any]]) -> None:
        """Have the API server validate the objects a new spec renders to (raises Refused); nothing is stored.
        One engine pod stands for all: they differ only in their index."""
        seen_pod = False
        for obj in objs:
            if obj["kind"] not in _DRY_RUN_KINDS or (obj["kind"] == "Pod" and seen_pod):
                continue
            seen_pod = seen_pod or obj["kind"] == "Pod"
            try:
                self.api.create(obj, dry_run=True)
            except Conflict:
                pass  # the name is taken by the live object; the server validated this one first

    def _desired(self, body: Mapping[str, Any], status: Mapping[str, Any]) -> _Desired:
        """The job and objects this pass applies: the newest spec when it is valid, the server accepts its
        objects and, on a running job, the edit keeps the trainer's progress; else the spec applied before,
        with the refusal. Raises (SpecError, Refused) when no spec was ever applied."""
        meta = body["metadata"]
        applied = applied_spec(self.api.get("v1", "ConfigMap", meta["namespace"], f"{meta['name']}-config"))
        try:
            body = self.stamp_image(body)
            job = parse_job(body)
            objs = render_job(job, body)
            if applied == body.get("spec"):
                return _Desired(job, objs)
            self._dry_run(objs)
            change = None
            if applied is not None:
                old_body = {**body, "spec": applied}
                old_job = parse_job(old_body)
                change = classify(applied, body.get("spec") or {}, render_job(old_job, old_body), objs)
                started = int(status.get("trainerActive") or 0) > 0 or status.get("step") is not None
                check_restart(change, old_job, job, started, status.get("step"))
            return _Desired(job, objs, change=change)
        except (SpecError, Refused, EditRefused) as err:
            if applied is None:
                raise
            reason = err.reason if isinstance(err, EditRefused) else (
                "RefusedByAPIServer" if isinstance(err, Refused) else st.INVALID_SPEC_REASON)
            old_body = {**body, "spec": applied}
            job = parse_job(old_body)
            return _Desired(job, render_job(job, old_body), refusal=(reason, f"{err}; the job keeps its last "
                                                                              "applied spec"))

    # ---- one pass ----
    def reconcile(self, body: Mapping[str, Any], now: str) -> dict[str, Any]:
        """One pass over the job `body` at time `now` (RFC 3339); returns the status fields to merge-patch.

        The job is re-read first: the copy an event delivered may predate the previous pass's status write,
        and the restart counters must build on the stored values. Whatever fails during the pass, the returned
        status holds what the pass did (restart counters) and names the failure.
        """
        meta = body["metadata"]
        fresh = self.api.get_job(meta["namespace"], meta["name"])
        if fresh is None or fresh["metadata"].get("uid") != meta.get("uid"):
            return {}
        try:
            # First: the write bumps metadata.generation, and the status must record the bumped one, or the
            # next pass would take the operator's own write for a user's edit and run the job again.
            body = self.stamp_image(fresh)
        except SpecError:
            body = fresh  # _desired raises it again, and the job fails naming it
        status = dict(body.get("status") or {})
        phase = status.get("phase")
        generation = int(body["metadata"].get("generation") or 0)
        conditions = list(status.get("conditions") or [])
        reopened = st.reopens(status, generation)
        if phase in st.TERMINAL and not reopened:
            return {}
        try:
            desired = self._desired(body, status)
        except (SpecError, Refused) as err:
            return self._refused_at_start(body, phase, status, conditions, now, generation, str(err))
        counts = _Counts(int(status.get("trainerRestarts") or 0), int(status.get("engineRestarts") or 0))
        try:
            obs, progress = self._act(desired, counts, status)
        except Refused as err:
            # Not foreseen by the checks above: report it once instead of retrying every pass.
            return self._refused_at_start(body, phase, status, conditions, now, generation, str(err), counts)
        except Exception as err:  # saved below with the counters; the next pass retries
            self.log.exception("reconcile of %s/%s failed", meta["namespace"], meta["name"])
            c = st.set_condition(conditions, st.RECONCILED, False, "Error", f"{type(err).__name__}: {err}", now,
                                 generation)
            return {"conditions": c, "trainerRestarts": counts.trainer_restarts,
                    "engineRestarts": counts.engine_restarts}
        job = desired.job
        patch = self._status(phase, obs, status, conditions, now, generation, progress, job.gang.timeout_seconds,
                             desired, reopened)
        patch.update(trainerRestarts=counts.trainer_restarts, engineRestarts=counts.engine_restarts)
        if patch["phase"] in st.TERMINAL:
            self._stop(job.namespace, job.name)
        return patch

    def _refused_at_start(self, body: Mapping[str, Any], phase: str | None, status: Mapping[str, Any],
                          conditions: list[dict[str, Any]], now: str, generation: int, message: str,
                          counts: _Counts | None = None) -> dict[str, Any]:
        """A job whose spec was never applied cannot run: Failed with reason InvalidSpec (a new spec reopens
        it), anything it started stopped."""
        meta = body["metadata"]
        obs = st.Observation(spec_error=message)
        conditions = st.set_condition(conditions, st.INVALID_SPEC, True, st.INVALID_SPEC_REASON, message, now,
                                      generation)
        patch = self._status(phase, obs, status, conditions, now, generation, st.Progress(None, None), None, None,
                             phase == st.FAILED)
        if counts is not None:
            patch.update(trainerRestarts=counts.trainer_restarts, engineRestarts=counts.engine_restarts)
        self.log.error("%s/%s: %s", meta["namespace"], meta["name"], message)
        self._stop(meta["namespace"], meta["name"])
        return patch

    def _act(self, desired: _Desired, counts: _Counts, status: Mapping[str, Any]) -> tuple[st.Observation,
                                                                                             st.Progress]:
        job, objs = desired.job, desired.objs
        ensure_key_secret(self.api, job, key_secret_metadata(job))  # before any pod that mounts it
        if desired.change is not None:
            self.log.info("%s/%s: applying %s (%s)", job.namespace, job.name, desired.change.describe(),
                          "trainer restart" if desired.change.trainer_restart else
                          "engines only, the trainer keeps running")
        for obj in objs:
            if obj["kind"] not in ("Job", "Pod"):
                apply_object(self.api, obj)
        job_obj = next(o for o in objs if o["kind"] == "Job")
        obs = self._trainer(job, job_obj, counts)
        pods = {o["metadata"]["name"]: o for o in objs if o["kind"] == "Pod"}
        prev_desired = status.get("enginesDesired")
        obs = self._engines(job, pods, counts, obs, int(prev_desired) if prev_desired is not None else None)
        return obs, self._progress(job)

    def _trainer(self, job: JobSpec, rendered: dict[str, Any], counts: _Counts) -> st.Observation:
        obs = st.Observation(trainer_replicas=job.trainer.replicas, engines_desired=job.rollout.engines)
        live = self.api.get(*_meta(rendered))
        if live is not None and _gone(live):
            return replace(obs, trainer_restarting=True)
        if live is not None:
            s = live.get("status") or {}
            if _index_done(s.get("completedIndexes"), 0) or _condition(live, "Complete"):
                return replace(obs, trainer_complete=True)
            if _condition(live, "Failed"):
                if counts.trainer_restarts >= job.fault_tolerance.max_trainer_restarts:
                    return replace(obs, trainer_exhausted=True)
                self.log.warning("trainer of %s/%s failed; restart %d from the newest checkpoint",
                                 job.namespace, job.name, counts.trainer_restarts + 1)
                self.api.delete(*_meta(rendered))
                counts.trainer_restarts += 1
                live = None
                obs = replace(obs, trainer_restarting=True, restart_reason="TrainerFailed")
            elif _hash(live) != _hash(rendered) or _parallelism(live) != _parallelism(rendered):
                # A new template (an applied edit), or workers scaled to zero when the job last stopped.
                self.log.info("trainer Job of %s/%s is outdated; replacing it (it resumes from the newest "
                              "checkpoint)", job.namespace, job.name)
                self.api.delete(*_meta(rendered))
                live = None
                obs = replace(obs, trainer_restarting=True, restart_reason="SpecChanged")
            else:
                return replace(obs, trainer_active=int(s.get("active") or 0))
        try:
            self.api.create(rendered)
        except Conflict:
            # The previous Job is still being deleted; the next pass creates it.
            return replace(obs, trainer_restarting=True)
        return obs

    def _engines(self, job: JobSpec, desired: dict[str, dict[str, Any]], counts: _Counts,
                 obs: st.Observation, prev_desired: int | None) -> st.Observation:
        live = {p["metadata"]["name"]: p for p in self.api.list("v1", "Pod", job.namespace, selector(job, "rollout"))}
        for name, pod in live.items():
            if name not in desired and not _gone(pod):
                self.api.delete("v1", "Pod", job.namespace, name)
        ready = alive = 0
        exhausted = False
        budget = job.fault_tolerance.max_engine_restarts
        for index, (name, rendered) in enumerate(sorted(desired.items(), key=lambda kv: int(kv[0].rsplit("-", 1)[1]))):
            pod = live.get(name)
            died = False
            if pod is not None and _gone(pod):
                continue
            if pod is not None and (pod.get("status") or {}).get("phase") in ("Failed", "Succeeded"):
                if counts.engine_restarts >= budget:
                    exhausted = True
                    continue
                self.log.warning("engine pod %s/%s exited (%s); replacing it", job.namespace, name,
                                 pod["status"]["phase"])
                self.api.delete("v1", "Pod", job.namespace, name)
                pod, died = None, True
            elif pod is not None and _hash(pod) != _hash(rendered):
                self.api.delete("v1", "Pod", job.namespace, name)
                pod = None
            elif pod is None and prev_desired is not None and index < prev_desired:
                # It existed on the previous pass and is gone: an engine lost (deleted or evicted).
                if counts.engine_restarts >= budget:
                    exhausted = True
                    continue
                self.log.warning("engine pod %s/%s disappeared; replacing it", job.namespace, name)
                died = True
            if pod is None:
                try:
                    self.api.create(rendered)
                except Conflict:
                    continue
                counts.engine_restarts += int(died)
                alive += 1
                continue
            alive += 1
            ready += int(_condition(pod, "Ready"))
        return replace(obs, engines_ready=ready, engines_alive=alive, engines_exhausted=exhausted)

    def _trainer_pod0(self, job: JobSpec) -> dict[str, Any] | None:
        pods = [p for p in self.api.list("v1", "Pod", job.namespace, selector(job, "trainer"))
                if (p["metadata"].get("annotations") or {}).get(COMPLETION_INDEX_ANNOTATION) == "0"
                and not _gone(p)]
        # Prefer the running attempt over finished predecessors.
        pods.sort(key=lambda p: ((p.get("status") or {}).get("phase") == "Running",
                                 p["metadata"].get("creationTimestamp") or ""))
        return pods[-1] if pods else None

    def _progress(self, job: JobSpec) -> st.Progress:
        c = self.config
        return st.trainer_progress(self._trainer_pod0(job), job.metrics_port, c.step_metric, c.checkpoint_metric,
                                   c.scrape_timeout_s)

    def _stop(self, namespace: str, name: str) -> None:
        """A finished job frees its GPUs: engines deleted, remaining trainer workers stopped (pod 0 kept for logs)."""
        engines = {JOB_LABEL: name, ROLE_LABEL: "rollout"}
        for pod in self.api.list("v1", "Pod", namespace, engines):
            if not _gone(pod):
                self.api.delete("v1", "Pod", namespace, pod["metadata"]["name"])
        trainer = f"{name}-trainer"
        live = self.api.get("batch/v1", "Job", namespace, trainer)
        if live is not None and _parallelism(live) != 0:
            self.api.patch("batch/v1", "Job", namespace, trainer, {"spec": {"parallelism": 0}})

    def _status(self, phase: str | None, obs: st.Observation, status: Mapping[str, Any],
                conditions: list[dict[str, Any]], now: str, generation: int, progress: st.Progress,
                gang_timeout_s: int | None, desired: _Desired | None, reopened: bool) -> dict[str, Any]:
        new_phase, reason, message = st.decide_phase(obs)
        st.transition(phase, new_phase, reopened=reopened)
        start = status.get("startTime") or now
        c = st.set_condition(conditions, st.TRAINER_READY, obs.trainer_active >= obs.trainer_replicas,
                             "TrainerRestarting" if obs.trainer_restarting else "Active",
                             f"{obs.trainer_active}/{obs.trainer_replicas} trainer pods active", now, generation)
        c = st.set_condition(c, st.ENGINES_READY, obs.engines_desired > 0 and obs.engines_ready >= obs.engines_desired,
                             "EnginesExhausted" if obs.engines_exhausted else "Ready",
                             f"{obs.engines_ready}/{obs.engines_desired} engines ready", now, generation)
        started = obs.trainer_active >= obs.trainer_replicas
        timeout = self._timed_out(start, now, gang_timeout_s)
        c = st.set_condition(c, st.GANG_SCHEDULED, started, "Started" if started else
                             ("Timeout" if timeout else "Waiting"),
                             "trainer gang started" if started else "waiting for the trainer gang to start", now,
                             generation)
        if desired is not None:
            c = self._edit_conditions(c, obs, status, desired, now, generation)
        c = st.set_condition(c, st.RECONCILED, True, "Reconciled", "the last pass completed", now, generation)
        if progress.problem:
            c = st.set_condition(c, st.PROGRESS_REPORTED, False, "MetricsUnreadable", progress.problem, now,
                                 generation)
        elif progress.step is not None:
            c = st.set_condition(c, st.PROGRESS_REPORTED, True, "Reported", f"step {progress.step}", now, generation)
        if new_phase == st.SUCCEEDED:
            c = st.set_condition(c, st.COMPLETE, True, reason, message, now, generation)
        if new_phase == st.FAILED:
            c = st.set_condition(c, st.FAILED_CONDITION, True, reason, message, now, generation)
        elif reopened:
            c = st.set_condition(c, st.FAILED_CONDITION, False, "SpecChanged",
                                 f"generation {generation} is valid; the job starts again", now, generation)
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
        elif reopened:
            patch["completionTime"] = None
        if desired is not None and desired.refusal is not None:
            patch["message"] = f"{message}; the newest spec is not applied: {desired.refusal[1]}"
        return patch

    @staticmethod
    def _edit_conditions(c: list[dict[str, Any]], obs: st.Observation, status: Mapping[str, Any],
                         desired: _Desired, now: str, generation: int) -> list[dict[str, Any]]:
        """InvalidSpec, Scaling and Restarting: whether the newest spec is applied and what applying it does."""
        if desired.refusal is not None:
            c = st.set_condition(c, st.INVALID_SPEC, True, desired.refusal[0], desired.refusal[1], now, generation)
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
            why = {"SpecChanged": f"applying {desired.change.describe() if desired.change else 'the new spec'}: ",
                   "TrainerFailed": "the trainer failed: "}.get(obs.restart_reason or "", "")
            reason = obs.restart_reason or old.get(st.RESTARTING, {}).get("reason") or "TrainerRestarting"
            c = st.set_condition(c, st.RESTARTING, True, reason,
                                 f"{why}the trainer restarts from its newest checkpoint", now, generation)
        elif old.get(st.RESTARTING, {}).get("status") == "True" and obs.trainer_active < obs.trainer_replicas:
            c = [x if x["type"] != st.RESTARTING else {**old[st.RESTARTING], "observedGeneration": generation}
                 for x in c]
        else:
            c = st.set_condition(c, st.RESTARTING, False, "Running", "no trainer restart in progress", now,
                                 generation)
        return c

    @staticmethod
    def _timed_out(start: str, now: str, timeout_s: int | None) -> bool:
        if timeout_s is None:
            return False
        try:
            waited = (datetime.fromisoformat(now.replace("Z", "+00:00"))
                      - datetime.fromisoformat(start.replace("Z", "+00:00"))).total_seconds()
        except ValueError:
            return False
        return waited > timeout_s
