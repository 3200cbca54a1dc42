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
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from launcher import report
from launcher import status as st
from launcher.changes import Change, EditRefused, applied_spec, check_restart, classify
from launcher.commands import ENGINES_FILE, engine_pod_name, engine_urls
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


def _scheduled(pod: Mapping[str, Any]) -> Mapping[str, Any] | None:
    return next((c for c in (pod.get("status") or {}).get("conditions") or [] if c.get("type") == "PodScheduled"),
                None)


def _unschedulable(pod: Mapping[str, Any]) -> bool:
    """A Pending pod the scheduler found no node for (PodScheduled False, reason Unschedulable)."""
    c = _scheduled(pod)
    return ((pod.get("status") or {}).get("phase") in (None, "Pending") and c is not None
            and c.get("status") == "False" and c.get("reason") == "Unschedulable")


def _scheduled_message(pod: Mapping[str, Any]) -> str:
    return str((_scheduled(pod) or {}).get("message") or "")


def publish_engines(api: KubeApi, job: JobSpec, unschedulable: tuple[str, ...]) -> None:
    """Write the engines the trainer's fleet should use into the job's ConfigMap (`engines`, which the running
    trainer follows): every desired engine but those the scheduler cannot place, in index order."""
    name = f"{job.name}-config"
    live = api.get("v1", "ConfigMap", job.namespace, name)
    if live is None:
        return
    urls = [u for i, u in enumerate(engine_urls(job)) if engine_pod_name(job, i) not in unschedulable]
    text = "\n".join(urls) + "\n"
    if (live.get("data") or {}).get(ENGINES_FILE) != text:
        api.patch("v1", "ConfigMap", job.namespace, name, {"data": {ENGINES_FILE: text}})


def _parallelism(job: Mapping[str, Any]) -> int | None:
    return (job.get("spec") or {}).get("parallelism")


@dataclass(frozen=True)
class _Deltas:
    """Restarts a pass counted (added to the stored counters when its status is written)."""

    trainer_restarts: int
    engine_restarts: int

    def counts(self) -> dict[str, int]:
        return {"trainer_restarts": self.trainer_restarts, "engine_restarts": self.engine_restarts}


@dataclass
class _Counts:
    """The restart counters as a pass sees them (stored values plus what it counted so far)."""

    trainer_restarts: int
    engine_restarts: int

    def deltas(self, status: Mapping[str, Any]) -> _Deltas:
        return _Deltas(self.trainer_restarts - int(status.get("trainerRestarts") or 0),
                       self.engine_restarts - int(status.get("engineRestarts") or 0))


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
        """One pass over the job `body` at time `now` (RFC 3339); writes the job's status and returns what it
        wrote. Call it under the job's lock (launcher/handlers.py): passes of one job must not interleave.

        The job is re-read first: the copy an event delivered may predate the previous pass's status write,
        and the restart counters must build on the stored values. The status is written before the pass
        returns, conditioned on the resourceVersion read (`write_status`), so no later pass reads a status
        older than this one's. Whatever fails during the pass, the status written holds what the pass did
        (restart counters) and names the failure.
        """
        meta = body["metadata"]
        fresh = self.api.get_job(meta["namespace"], meta["name"])
        if fresh is None or fresh["metadata"].get("uid") != meta.get("uid"):
            return {}
        if _gone(fresh):
            return self.mark_terminating(fresh, now)
        try:
            # First: the write bumps metadata.generation, and the status must record the bumped one, or the
            # next pass would take the operator's own write for a user's edit and run the job again.
            body = self.stamp_image(fresh)
        except SpecError:
            body = fresh  # _desired raises it again, and the job fails naming it
        status = dict(body.get("status") or {})
        phase = status.get("phase")
        generation = int(body["metadata"].get("generation") or 0)
        reopened = st.reopens(status, generation)
        if phase in st.TERMINAL and not reopened:
            return {}
        try:
            desired = self._desired(body, status)
        except (SpecError, Refused) as err:
            return self._refused_at_start(body, phase, now, generation, str(err))
        counts = _Counts(int(status.get("trainerRestarts") or 0), int(status.get("engineRestarts") or 0))
        replacing = set(status.get("replacing") or [])
        try:
            obs, progress = self._act(desired, counts, status, replacing)
        except Refused as err:
            # Not foreseen by the checks above: report it once instead of retrying every pass.
            return self._refused_at_start(body, phase, now, generation, str(err), counts.deltas(status))
        except Exception as err:  # saved below with the counters; the next pass retries
            self.log.exception("reconcile of %s/%s failed", meta["namespace"], meta["name"])
            text = f"{type(err).__name__}: {err}"
            deltas = counts.deltas(status)

            def failed(stored: Mapping[str, Any]) -> dict[str, Any]:
                c = st.set_condition(list(stored.get("conditions") or []), st.RECONCILED, False, "Error", text,
                                     now, generation)
                return {"conditions": c, **report.counters(stored, deltas.trainer_restarts, deltas.engine_restarts,
                                                           tuple(replacing))}

            return self.write_status(body, failed)
        result = report.PassResult(obs, progress, generation, reopened, desired.job.gang.timeout_seconds,
                                   replacing=tuple(replacing), refusal=desired.refusal, change=desired.change,
                                   **counts.deltas(status).counts())
        patch = self.write_status(body, lambda stored: report.compose(stored, result, now))
        if patch.get("phase") in st.TERMINAL:
            self._stop(desired.job.namespace, desired.job.name)
        return patch

    def write_status(self, body: Mapping[str, Any], compose: Callable[[Mapping[str, Any]], dict[str, Any]],
                     attempts: int = 5) -> dict[str, Any]:
        """Merge-patch the status `compose(stored status)` on the job `body`, conditioned on its resourceVersion;
        when the job changed meanwhile (kopf's own annotations, another operator), compose again on the newer
        status. Returns the patch written (empty: nothing to write, or the job is gone)."""
        meta = body["metadata"]
        ns, name, uid = meta["namespace"], meta["name"], meta.get("uid")
        current: Mapping[str, Any] | None = body
        for _ in range(attempts):
            if current is None or current["metadata"].get("uid") != uid:
                return {}
            patch = compose(current.get("status") or {})
            if not patch:
                return {}
            version = current["metadata"].get("resourceVersion")
            try:
                self.api.patch(API_VERSION, KIND, ns, name, {"metadata": {"resourceVersion": version},
                                                            "status": patch}, "status")
                return patch
            except Conflict:
                current = self.api.get_job(ns, name)
        raise Conflict(f"MilesJob {ns}/{name} changed on each of {attempts} status writes; the next pass retries")

    def mark_terminating(self, body: Mapping[str, Any], now: str) -> dict[str, Any]:
        """Record that the job's deletion was requested (phase Terminating); nothing is created any more."""
        generation = int(body["metadata"].get("generation") or 0)
        return self.write_status(body, lambda stored: report.terminating(stored, now, generation))

    def _refused_at_start(self, body: Mapping[str, Any], phase: str | None, now: str, generation: int, message: str,
                          deltas: _Deltas | None = None) -> dict[str, Any]:
        """A job whose spec was never applied cannot run: Failed with reason InvalidSpec (a new spec reopens
        it), anything it started stopped."""
        meta = body["metadata"]
        result = report.PassResult(st.Observation(spec_error=message), st.Progress(None, None), generation,
                                   phase == st.FAILED, has_desired=False,
                                   extra=[(st.INVALID_SPEC, True, st.INVALID_SPEC_REASON, message)],
                                   **(deltas.counts() if deltas else {}))
        patch = self.write_status(body, lambda stored: report.compose(stored, result, now))
        self.log.error("%s/%s: %s", meta["namespace"], meta["name"], message)
        self._stop(meta["namespace"], meta["name"])
        return patch

    def _act(self, desired: _Desired, counts: _Counts, status: Mapping[str, Any],
             replacing: set[str]) -> tuple[st.Observation, st.Progress]:
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
        obs = self._trainer(job, job_obj, counts, int(status.get("trainerActive") or 0))
        pods = {o["metadata"]["name"]: o for o in objs if o["kind"] == "Pod"}
        prev_desired = status.get("enginesDesired")
        obs = self._engines(job, pods, counts, obs, int(prev_desired) if prev_desired is not None else None,
                            replacing)
        publish_engines(self.api, job, obs.engines_unschedulable)
        return obs, self._progress(job)

    def _trainer(self, job: JobSpec, rendered: dict[str, Any], counts: _Counts, was_active: int) -> st.Observation:
        """Create, heal or replace the trainer Job. `was_active`: its active pods at the last pass (a Job that
        vanished after running was deleted by someone: a restart counted like a failure)."""
        obs = st.Observation(trainer_replicas=job.trainer.replicas, engines_desired=job.rollout.engines)
        live = self.api.get(*_meta(rendered))
        if live is not None and _gone(live):
            return replace(obs, trainer_restarting=True)
        if live is None and was_active > 0:
            if counts.trainer_restarts >= job.fault_tolerance.max_trainer_restarts:
                return replace(obs, trainer_exhausted=True)
            self.log.warning("trainer Job of %s/%s was deleted while it ran; restart %d from the newest checkpoint",
                             job.namespace, job.name, counts.trainer_restarts + 1)
            counts.trainer_restarts += 1
            obs = replace(obs, trainer_restarting=True, restart_reason=st.RESTART_TRAINER_GONE)
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
                obs = replace(obs, trainer_restarting=True, restart_reason=st.RESTART_TRAINER_FAILED)
            elif _hash(live) != _hash(rendered) or _parallelism(live) != _parallelism(rendered):
                # A new template (an applied edit), or workers scaled to zero when the job last stopped.
                self.log.info("trainer Job of %s/%s is outdated; replacing it (it resumes from the newest "
                              "checkpoint)", job.namespace, job.name)
                self.api.delete(*_meta(rendered))
                live = None
                obs = replace(obs, trainer_restarting=True, restart_reason=st.RESTART_SPEC_CHANGED)
            else:
                return replace(obs, trainer_active=int(s.get("active") or 0))
        try:
            self.api.create(rendered)
        except Conflict:
            # The previous Job is still being deleted; the next pass creates it.
            return replace(obs, trainer_restarting=True)
        return obs

    def _engines(self, job: JobSpec, desired: dict[str, dict[str, Any]], counts: _Counts,
                 obs: st.Observation, prev_desired: int | None, replacing: set[str]) -> st.Observation:
        """Replace engine pods that failed, exited or vanished (each counted once), delete the ones beyond
        spec.rollout.engines. `replacing` (updated in place): pods this operator deleted on purpose and has not
        recreated yet; their absence is not a loss."""
        live = {p["metadata"]["name"]: p for p in self.api.list("v1", "Pod", job.namespace, selector(job, "rollout"))}
        for name, pod in live.items():
            if name not in desired and not _gone(pod):
                self.api.delete("v1", "Pod", job.namespace, name)
        replacing.intersection_update(desired)
        ready = alive = 0
        exhausted = False
        unschedulable: list[str] = []
        why_unschedulable = ""
        budget = job.fault_tolerance.max_engine_restarts
        for index, (name, rendered) in enumerate(sorted(desired.items(), key=lambda kv: int(kv[0].rsplit("-", 1)[1]))):
            pod = live.get(name)
            if pod is not None and _gone(pod):
                continue
            if pod is not None and (pod.get("status") or {}).get("phase") in ("Failed", "Succeeded"):
                if counts.engine_restarts >= budget:
                    exhausted = True
                    continue
                self.log.warning("engine pod %s/%s exited (%s); replacing it", job.namespace, name,
                                 pod["status"]["phase"])
                self.api.delete("v1", "Pod", job.namespace, name)
                counts.engine_restarts += 1
                replacing.add(name)
                pod = None
            elif pod is not None and _hash(pod) != _hash(rendered):
                self.api.delete("v1", "Pod", job.namespace, name)
                replacing.add(name)
                pod = None
            elif pod is None and name not in replacing and prev_desired is not None and index < prev_desired:
                # It existed on the previous pass and is gone: an engine lost (deleted or evicted).
                if counts.engine_restarts >= budget:
                    exhausted = True
                    continue
                self.log.warning("engine pod %s/%s disappeared; replacing it", job.namespace, name)
                counts.engine_restarts += 1
                replacing.add(name)
            if pod is None:
                try:
                    self.api.create(rendered)
                except Conflict:
                    continue  # its predecessor is still being deleted: created by a later pass, not counted again
                replacing.discard(name)
                alive += 1
                continue
            alive += 1
            ready += int(_condition(pod, "Ready"))
            if _unschedulable(pod):
                unschedulable.append(name)
                why_unschedulable = why_unschedulable or _scheduled_message(pod)
        return replace(obs, engines_ready=ready, engines_alive=alive, engines_exhausted=exhausted,
                       engines_unschedulable=tuple(unschedulable), unschedulable_message=why_unschedulable)

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
