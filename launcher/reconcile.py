"""One reconciliation pass of a MilesJob: make the cluster match the rendered objects, heal, report.

- Supporting objects (ConfigMap, Services, PodGroups) are created when missing and merge-patched when
  their spec hash differs.
- The trainer Job: created when missing; replaced when its template changed; when it failed, deleted and
  recreated (its command resumes from the newest checkpoint: checkpoint.resume=auto), counted in
  `status.trainerRestarts` up to spec.faultTolerance.maxTrainerRestarts. Trainer pod 0 completing = success.
- Engine pods: a pod that failed, exited or vanished is replaced without touching the trainer, counted in
  `status.engineRestarts` up to maxEngineRestarts; pods beyond spec.rollout.engines are deleted.
- Status: phase (status.py's state machine), conditions, engine counts, step and last checkpoint.
A finished job (Succeeded or Failed) stops its engines and the trainer's remaining workers.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

from launcher import status as st
from launcher.commands import trainer_name
from launcher.kube import Conflict, KubeApi
from launcher.render import HASH_ANNOTATION, key_secret_metadata, render_job, selector
from launcher.security import ensure_key_secret, secret_name
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


@dataclass
class _Counts:
    trainer_restarts: int
    engine_restarts: int


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
        self.api.patch(API_VERSION, KIND, m["namespace"], m["name"], {"spec": {"image": image}})
        self.log.info("%s/%s: spec.image set to the operator's default %s", m["namespace"], m["name"], image)
        return {**body, "spec": {**spec, "image": image}}

    # ---- create / resume / update: apply everything, count nothing ----
    def apply_all(self, body: Mapping[str, Any]) -> list[str]:
        """Apply every rendered object of the job (idempotent); returns 'Kind/name: action' lines."""
        body = self.stamp_image(body)
        job = parse_job(body)
        out = [f"Secret/{secret_name(job)}: {ensure_key_secret(self.api, job, key_secret_metadata(job))}"]
        for obj in render_job(job, body):
            if obj["kind"] in ("Job", "Pod"):
                live = self.api.get(*_meta(obj))
                if live is not None and _hash(live) != _hash(obj) and not _gone(live):
                    # Pods and Job templates are immutable: a changed one is replaced.
                    self.api.delete(*_meta(obj))
                    live = None
                if live is None:
                    try:
                        self.api.create(obj)
                        out.append(f"{obj['kind']}/{obj['metadata']['name']}: created")
                    except Conflict:
                        out.append(f"{obj['kind']}/{obj['metadata']['name']}: pending deletion")
                continue
            out.append(f"{obj['kind']}/{obj['metadata']['name']}: {apply_object(self.api, obj)}")
        return out

    # ---- timer: heal and report ----
    def reconcile(self, body: Mapping[str, Any], now: str) -> dict[str, Any]:
        """One pass over the job `body` at time `now` (RFC 3339); returns the status fields to merge-patch.

        The job is re-read first: the copy an event delivered may predate the previous pass's status write,
        and the restart counters must build on the stored values.
        """
        meta = body["metadata"]
        fresh = self.api.get_job(meta["namespace"], meta["name"])
        if fresh is None or fresh["metadata"].get("uid") != meta.get("uid"):
            return {}
        body = fresh
        status = dict(body.get("status") or {})
        phase = status.get("phase")
        generation = int(body["metadata"].get("generation") or 0)
        conditions = list(status.get("conditions") or [])
        if phase in st.TERMINAL:
            return {}
        try:
            body = self.stamp_image(body)
            job = parse_job(body)
            objs = render_job(job, body)
        except SpecError as err:
            obs = st.Observation(spec_error=str(err))
            return self._status(phase, obs, status, conditions, now, generation, None, None)
        counts = _Counts(int(status.get("trainerRestarts") or 0), int(status.get("engineRestarts") or 0))
        ensure_key_secret(self.api, job, key_secret_metadata(job))  # before any pod that mounts it
        for obj in objs:
            if obj["kind"] not in ("Job", "Pod"):
                apply_object(self.api, obj)
        job_obj = next(o for o in objs if o["kind"] == "Job")
        obs = self._trainer(job, job_obj, counts)
        pods = {o["metadata"]["name"]: o for o in objs if o["kind"] == "Pod"}
        prev_desired = status.get("enginesDesired")
        obs = self._engines(job, pods, counts, obs, int(prev_desired) if prev_desired is not None else None)
        step, ckpt = self._progress(job)
        patch = self._status(phase, obs, status, conditions, now, generation, step, ckpt, job.gang.timeout_seconds)
        patch.update(trainerRestarts=counts.trainer_restarts, engineRestarts=counts.engine_restarts)
        if patch["phase"] in st.TERMINAL:
            self._stop(job)
        return patch

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
                obs = replace(obs, trainer_restarting=True)
            elif _hash(live) != _hash(rendered):
                self.api.delete(*_meta(rendered))
                live = None
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

    def _progress(self, job: JobSpec) -> tuple[int | None, str | None]:
        c = self.config
        return st.trainer_progress(self._trainer_pod0(job), job.metrics_port, c.step_metric, c.checkpoint_metric,
                                   c.scrape_timeout_s)

    def _stop(self, job: JobSpec) -> None:
        """A finished job frees its GPUs: engines deleted, remaining trainer workers stopped (pod 0 kept for logs)."""
        for pod in self.api.list("v1", "Pod", job.namespace, selector(job, "rollout")):
            self.api.delete("v1", "Pod", job.namespace, pod["metadata"]["name"])
        if self.api.get("batch/v1", "Job", job.namespace, trainer_name(job)) is not None:
            self.api.patch("batch/v1", "Job", job.namespace, trainer_name(job), {"spec": {"parallelism": 0}})

    def _status(self, phase: str | None, obs: st.Observation, status: Mapping[str, Any],
                conditions: list[dict[str, Any]], now: str, generation: int, step: int | None,
                ckpt: str | None, gang_timeout_s: int | None = None) -> dict[str, Any]:
        new_phase, reason, message = st.decide_phase(obs)
        st.transition(phase, new_phase)
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
        if new_phase == st.SUCCEEDED:
            c = st.set_condition(c, st.COMPLETE, True, reason, message, now, generation)
        if new_phase == st.FAILED:
            c = st.set_condition(c, st.FAILED_CONDITION, True, reason, message, now, generation)
        patch: dict[str, Any] = {
            "phase": new_phase, "message": message, "observedGeneration": generation, "conditions": c,
            "startTime": start, "enginesReady": obs.engines_ready, "enginesDesired": obs.engines_desired,
            "engines": f"{obs.engines_ready}/{obs.engines_desired}", "trainerActive": obs.trainer_active,
        }
        if step is not None:
            patch["step"] = step
        if ckpt is not None:
            patch["lastCheckpoint"] = ckpt
        if new_phase in st.TERMINAL:
            patch["completionTime"] = now
        return patch

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
