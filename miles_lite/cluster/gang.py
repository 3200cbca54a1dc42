"""Gang scheduling of the two roles with Ray placement groups: all of a role's bundles or none.

The trainer is one gang (one bundle per rank); the rollout engines are another (one bundle per
engine). Creating a gang waits for every bundle up to a timeout, then fails with an error that names
the role, what it asked for and what the cluster is missing: never a half-started role.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from miles_lite.config.schema import MilesConfig


class GangSchedulingError(RuntimeError):
    """A role's placement group could not be reserved in time."""


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


def trainer_gang(cfg: MilesConfig) -> GangSpec:
    """One bundle per trainer rank (tp * dp * pp ranks), packed to keep TP groups on a node."""
    world = cfg.trainer.world_size
    gpus = cfg.cluster.trainer_gpus_per_rank
    resource = cfg.cluster.trainer_resource
    if cfg.cluster.placement == "colocated":
        # Engines share these bundles: each bundle also carries one engine's CPU share.
        cpus = 1.0 + cfg.cluster.cpus_per_engine
        return GangSpec("trainer", tuple(_bundle(cpus, gpus, resource) for _ in range(world)), "PACK")
    return GangSpec("trainer", tuple(_bundle(1.0, gpus, resource) for _ in range(world)), "PACK")


def rollout_gang(cfg: MilesConfig) -> GangSpec | None:
    """One bundle per engine holding all of its TP GPUs; None when colocated (engines use the trainer's)."""
    if cfg.cluster.placement == "colocated":
        return None
    gpus = cfg.cluster.engine_gpus * cfg.rollout.engine_tp
    bundles = tuple(_bundle(cfg.cluster.cpus_per_engine, gpus, cfg.cluster.rollout_resource)
                    for _ in range(cfg.rollout.engines))
    return GangSpec("rollout", bundles, "PACK")


def missing_resources(spec: GangSpec, available: dict[str, float]) -> dict[str, float]:
    """What `spec` needs beyond `available`, summed over bundles (resource -> amount short)."""
    return {
        name: round(amount - available.get(name, 0.0), 6)
        for name, amount in spec.total().items()
        if amount > available.get(name, 0.0) + 1e-9
    }


def reserve(spec: GangSpec, timeout_s: float):
    """Create `spec`'s placement group and wait until every bundle is reserved.

    Returns the Ray `PlacementGroup`. On timeout the group is removed and `GangSchedulingError`
    names the role, its request, the cluster's free resources and what is missing.
    """
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

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
    keep = ("CPU", "GPU", "memory")
    return {k: round(v, 3) for k, v in resources.items() if k in keep or not k.startswith("node:")}
