"""Gang scheduling of one role (trainer or rollout): the objects, labels and annotations each backend reads.

- volcano: a `scheduling.volcano.sh/v1beta1` PodGroup per role; pods use schedulerName `volcano` and the
  `scheduling.k8s.io/group-name` annotation.
- coscheduling (scheduler-plugins): a `scheduling.x-k8s.io/v1alpha1` PodGroup per role with
  `scheduleTimeoutSeconds`; pods carry the `scheduling.x-k8s.io/pod-group` label.
- kueue: no object; the trainer Job carries `kueue.x-k8s.io/queue-name` (one Workload for all its pods) and
  the engine pods form a Kueue pod group (`pod-group-name` label, `pod-group-total-count` annotation).
- none: the default scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from launcher.spec import JobSpec

VOLCANO_API = "scheduling.volcano.sh/v1beta1"
COSCHEDULING_API = "scheduling.x-k8s.io/v1alpha1"
DEFAULT_SCHEDULER_NAME = {"volcano": "volcano", "coscheduling": "scheduler-plugins-scheduler"}


@dataclass(frozen=True)
class RoleGang:
    """How one role's pods join their gang: pod labels/annotations, the scheduler, and labels of the owning Job."""

    pod_labels: dict[str, str] = field(default_factory=dict)
    pod_annotations: dict[str, str] = field(default_factory=dict)
    scheduler_name: str | None = None
    workload_labels: dict[str, str] = field(default_factory=dict)


def role_gang(job: JobSpec, group_name: str, members: int, owned_by_job: bool) -> RoleGang:
    """The gang membership of a role whose `members` pods form group `group_name`.

    `owned_by_job`: the pods belong to a batch Job (Kueue then admits the Job, not the pods).
    """
    g = job.gang
    scheduler = g.scheduler_name or DEFAULT_SCHEDULER_NAME.get(g.scheduler)
    if g.scheduler == "volcano":
        labels = {"volcano.sh/queue-name": g.queue} if g.queue else {}
        return RoleGang(labels, {"scheduling.k8s.io/group-name": group_name}, scheduler)
    if g.scheduler == "coscheduling":
        return RoleGang({"scheduling.x-k8s.io/pod-group": group_name}, {}, scheduler)
    if g.scheduler == "kueue":
        queue = {"kueue.x-k8s.io/queue-name": str(g.queue)}
        if owned_by_job:
            return RoleGang({}, {}, scheduler, workload_labels=queue)
        return RoleGang(
            {**queue, "kueue.x-k8s.io/pod-group-name": group_name},
            {"kueue.x-k8s.io/pod-group-total-count": str(members)},
            scheduler,
        )
    return RoleGang(scheduler_name=scheduler)


def pod_group(job: JobSpec, group_name: str, members: int, gpus_per_member: int,
              metadata: dict[str, Any]) -> dict[str, Any] | None:
    """The PodGroup object of a role for volcano/coscheduling (None for kueue and none).

    `metadata` supplies labels and ownerReferences; `minResources` asks for all of the role's GPUs at once.
    """
    g = job.gang
    min_resources = {"nvidia.com/gpu": str(members * gpus_per_member)} if gpus_per_member else None
    if g.scheduler == "volcano":
        spec: dict[str, Any] = {"minMember": members}
        if g.queue:
            spec["queue"] = g.queue
        api = VOLCANO_API
    elif g.scheduler == "coscheduling":
        spec = {"minMember": members, "scheduleTimeoutSeconds": g.timeout_seconds}
        api = COSCHEDULING_API
    else:
        return None
    if min_resources:
        spec["minResources"] = min_resources
    return {"apiVersion": api, "kind": "PodGroup", "metadata": {**metadata, "name": group_name}, "spec": spec}
