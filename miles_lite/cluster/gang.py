"""Gang scheduling of the two roles with Ray placement groups: all of a role's bundles or none.

The trainer is one gang (one bundle per rank); the rollout engines are another (one bundle per
engine). A gang that cannot fit the cluster's total resources (less what this job's other gangs hold),
or a bundle larger than every node, fails at once with what it asks and what the cluster has, in one
line. Otherwise creating a gang waits for every bundle up to a timeout, then fails with an error that
names the role, what it asked for and what the cluster is missing: never a half-started role.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from miles_lite.config.schema import ClusterConfig, RolloutConfig, TrainerConfig


class GangSchedulingError(RuntimeError):
    """A role's placement group could not be reserved in time."""


class GangDoesNotFit(GangSchedulingError):
    """A role's gang asks more than the cluster has in total: waiting cannot help."""


@dataclass(frozen=True)
class GangSpec:
    """The resources of one role: `bundles[i]` is what rank/engine i needs (Ray resource names)."""

    role: str
    bundles: tuple[dict[str, float], ...]
    strategy: str = "PACK"

    def total(self) -> dict[str, float]:
        """Resources of all bundles added up."""
        total: Counter[str] = Counter()
        for bundle in self.bundles:
            total.update(bundle)
        return dict(total)


def _bundle(cpus: float, gpus: float, resource: str | None) -> dict[str, float]:
    bundle = {"CPU": float(cpus)}
    if gpus > 0:
        bundle["GPU"] = float(gpus)
    if resource:
        # One unit of the role's custom resource pins the bundle to the nodes started for that role.
        bundle[resource] = 1.0
    return bundle


def trainer_gang(trainer: TrainerConfig, cluster: ClusterConfig) -> GangSpec:
    """One bundle per trainer rank (tp * dp * pp ranks), packed to keep TP groups on a node."""
    world = trainer.world_size
    gpus = cluster.trainer_gpus_per_rank
    resource = cluster.trainer_resource
    if cluster.placement == "colocated":
        # Engines share these bundles: each bundle also carries one engine's CPU share.
        cpus = 1.0 + cluster.cpus_per_engine
        return GangSpec("trainer", tuple(_bundle(cpus, gpus, resource) for _ in range(world)), "PACK")
    return GangSpec("trainer", tuple(_bundle(1.0, gpus, resource) for _ in range(world)), "PACK")


def rollout_gang(rollout: RolloutConfig, cluster: ClusterConfig) -> GangSpec | None:
    """One bundle per engine holding all of its TP GPUs; None when colocated (engines use the trainer's)."""
    if cluster.placement == "colocated":
        return None
    gpus = cluster.engine_gpus * rollout.engine_tp
    bundles = tuple(_bundle(cluster.cpus_per_engine, gpus, cluster.rollout_resource)
                    for _ in range(rollout.engines))
    return GangSpec("rollout", bundles, "PACK")


def missing_resources(spec: GangSpec, available: dict[str, float]) -> dict[str, float]:
    """What `spec` needs beyond `available`, summed over bundles (resource -> amount short)."""
    return {
        name: round(amount - available.get(name, 0.0), 6)
        for name, amount in spec.total().items()
        if amount > available.get(name, 0.0) + 1e-9
    }


_HINT = "lower the request (trainer.tp/dp/pp, rollout.engines, rollout.engine_tp, cluster.*gpus*, " \
        "cluster.cpus_per_engine) or add nodes"


def _fmt(resources: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:g}" for k, v in sorted(resources.items())) or "nothing"


def fit_problem(spec: GangSpec, total: dict[str, float], held: dict[str, float] | None = None,
                nodes: list[dict[str, float]] | None = None) -> str | None:
    """Why `spec` can never be placed, in one line, or None: its total exceeds the cluster's `total` less what
    this job's other gangs `held`, or one of its bundles is larger than every node in `nodes`."""
    held = held or {}
    room = {k: total.get(k, 0.0) - held.get(k, 0.0) for k in set(total) | set(spec.total())}
    short = {k: v for k, v in spec.total().items() if v > room.get(k, 0.0) + 1e-9}
    if short:
        asked = {k: spec.total()[k] for k in short}
        have = {k: total.get(k, 0.0) for k in short}
        taken = {k: held[k] for k in short if held.get(k)}
        also = f" ({_fmt(taken)} of it held by this job's other gang)" if taken else ""
        return (f"the {spec.role} gang ({len(spec.bundles)} bundles) asks {_fmt(asked)}; the cluster has "
                f"{_fmt(have)} in total{also}; {_HINT}")
    if nodes:
        for bundle in spec.bundles:
            if not any(all(node.get(k, 0.0) + 1e-9 >= v for k, v in bundle.items()) for node in nodes):
                largest = {k: max(node.get(k, 0.0) for node in nodes) for k in bundle}
                return (f"one {spec.role} bundle asks {_fmt(bundle)}; the largest node has {_fmt(largest)}; "
                        f"{_HINT}")
        if len({tuple(sorted(b.items())) for b in spec.bundles}) == 1:
            # Identical bundles (every gang here): how many each node can hold is exact arithmetic.
            bundle = spec.bundles[0]
            fits = sum(min(int((node.get(k, 0.0) + 1e-9) // v) for k, v in bundle.items() if v > 0)
                       for node in nodes)
            if fits < len(spec.bundles):
                return (f"the {spec.role} gang asks {len(spec.bundles)} bundles of {_fmt(bundle)}; the cluster's "
                        f"nodes hold {fits} such bundle(s) (nodes: {'; '.join(_fmt(n) for n in nodes)}); {_HINT}")
    return None


def _node_resources() -> list[dict[str, float]]:
    import ray

    keep = ("CPU", "GPU")
    return [{k: v for k, v in (n.get("Resources") or {}).items() if k in keep or k.startswith("miles")
             or not (k.startswith("node:") or k.startswith("bundle_group_") or "memory" in k)}
            for n in ray.nodes() if n.get("Alive")]


def reserve(spec: GangSpec, timeout_s: float, held: tuple[GangSpec, ...] = ()):
    """Create `spec`'s placement group and wait until every bundle is reserved.

    `held`: this job's gangs already reserved (the rollout gang is reserved after the trainer's).
    Returns the Ray `PlacementGroup`. A gang that can never fit raises `GangDoesNotFit` at once (asked vs
    available); on timeout the group is removed and `GangSchedulingError` names the role, its request,
    the cluster's free resources and what is missing.
    """
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    taken: Counter[str] = Counter()
    for other in held:
        taken.update(other.total())
    problem = fit_problem(spec, dict(ray.cluster_resources()), dict(taken), _node_resources())
    if problem:
        raise GangDoesNotFit(problem)
    pg = placement_group(list(spec.bundles), strategy=spec.strategy, name=f"miles-lite-{spec.role}")
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if ready:
        return pg
    available = ray.available_resources()
    remove_placement_group(pg)
    missing = missing_resources(spec, available)
    detail = f"missing {missing}" if missing else "resources exist in total but not in a placement that fits"
    raise GangSchedulingError(
        f"the {spec.role} gang ({len(spec.bundles)} bundles, {spec.strategy}, total {spec.total()}) was not "
        f"scheduled within {timeout_s:.0f} s; cluster has free {_round(available)}; {detail}. Add nodes or "
        f"lower the request (trainer.tp/dp, rollout.engines, cluster.*_gpus*)"
    )


def _round(resources: dict[str, float]) -> dict[str, float]:
    # Ray's own bookkeeping resources (node:*, bundle_group_* of placement groups) mean nothing to a user.
    keep = ("CPU", "GPU", "memory")
    return {k: round(v, 3) for k, v in resources.items()
            if k in keep or not (k.startswith("node:") or k.startswith("bundle_group_"))}
