"""Check a job's configuration and placement before any service starts (run by slurm/train.sh).

    python preflight.py [--trainer NODES,GPUS,CPUS --rollout NODES,GPUS,CPUS] -- OVERRIDE...

1. The overrides compose into a typed configuration: unknown keys are named with the closest known ones and
   values of the wrong type with the type wanted, as `miles-lite train` reports them. (Its semantic checks,
   which import torch, run in the driver; their error line reaches the batch log too.)
2. With the role shares given (nodes of the role, GPUs and CPUs of each), each role's gang fits its share:
   otherwise Ray would wait `cluster.placement_timeout_s` for resources the allocation does not have.
Problems go to stderr, one line each; the exit code is 2 for a bad configuration, 3 for a placement that
cannot fit, 0 otherwise.
"""

from __future__ import annotations

import argparse
import sys


def share(text: str) -> tuple[int, int, int]:
    """NODES,GPUS,CPUS (GPUs and CPUs per node) -> three integers."""
    try:
        nodes, gpus, cpus = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected NODES,GPUS,CPUS, got {text!r}") from None
    return nodes, gpus, cpus


def role_nodes(nodes: int, gpus: int, cpus: int, resource: str | None) -> list[dict[str, float]]:
    """The Ray nodes slurm/lib/ray_node.sh starts for a role's share: its CPUs, GPUs and role resource (one unit
    per GPU, or per CPU on GPU-less nodes)."""
    node = {"CPU": float(cpus), "GPU": float(gpus)}
    if resource:
        node[resource] = float(gpus or cpus)
    return [dict(node) for _ in range(nodes)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="preflight.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trainer", type=share, default=None, help="trainer share: NODES,GPUS,CPUS")
    p.add_argument("--rollout", type=share, default=None, help="rollout share: NODES,GPUS,CPUS")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)

    from miles_lite.cli.train import compose_or_explain
    from miles_lite.cluster.gang import fit_problem, rollout_gang, trainer_gang

    cfg = compose_or_explain(argparse.Namespace(overrides=args.overrides, config_dir=None, config_name="config"),
                             check=False)
    if cfg is None:
        return 2
    if cfg.cluster.mode != "ray" or args.trainer is None or args.rollout is None:
        return 0
    problems = []
    shares = ((trainer_gang(cfg.trainer, cfg.cluster), args.trainer, cfg.cluster.trainer_resource),
              (rollout_gang(cfg.rollout, cfg.cluster), args.rollout, cfg.cluster.rollout_resource))
    for spec, (n, gpus, cpus), resource in shares:
        if spec is None:
            continue  # colocated engines live in the trainer's bundles
        nodes = role_nodes(n, gpus, cpus, resource)
        total = {k: sum(node[k] for node in nodes) for k in nodes[0]} if nodes else {}
        problem = fit_problem(spec, total, nodes=nodes)
        if problem:
            where = f"the {spec.role} share of the allocation ({n} node(s), {gpus} GPU(s) and {cpus} CPU(s) each)"
            problems.append(problem.replace("the cluster", where).replace("the largest node", "each node"))
    for line in problems:
        print(f"miles-lite train: placement: {line}", file=sys.stderr)
    return 3 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
