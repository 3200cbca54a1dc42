"""Gang specs: bundles per role from the configuration, and the missing-resource arithmetic."""

from miles_lite.cluster.gang import missing_resources, rollout_gang, trainer_gang
from miles_lite.config import load_config


def test_disaggregated_roles_get_separate_bundles():
    cfg = load_config(["cluster=ray", "trainer.tp=2", "trainer.dp=2", "rollout.engines=3", "rollout.engine_tp=2"])
    trainer, rollout = trainer_gang(cfg.trainer, cfg.cluster), rollout_gang(cfg.rollout, cfg.cluster)
    assert len(trainer.bundles) == 4 and trainer.total() == {"CPU": 4.0, "GPU": 4.0}
    assert rollout is not None and len(rollout.bundles) == 3
    assert rollout.bundles[0] == {"CPU": 1.0, "GPU": 2.0}


def test_colocated_engines_share_trainer_bundles():
    cfg = load_config(["cluster=ray_colocated", "trainer.tp=2", "rollout.engines=2"])
    assert rollout_gang(cfg.rollout, cfg.cluster) is None
    assert trainer_gang(cfg.trainer, cfg.cluster).bundles == ({"CPU": 2.0, "GPU": 1.0}, {"CPU": 2.0, "GPU": 1.0})


def test_missing_resources_names_what_is_short():
    cfg = load_config(["cluster=ray", "rollout.engines=4"])
    spec = rollout_gang(cfg.rollout, cfg.cluster)
    assert spec is not None
    assert missing_resources(spec, {"CPU": 8.0, "GPU": 2.0}) == {"GPU": 2.0}
    assert missing_resources(spec, {"CPU": 8.0, "GPU": 4.0}) == {}


def test_role_resources_pin_each_bundle_to_its_role_nodes():
    cfg = load_config(["cluster=ray", "trainer.tp=2", "rollout.engines=2", "cluster.trainer_resource=miles_trainer",
                       "cluster.rollout_resource=miles_rollout"])
    assert trainer_gang(cfg.trainer, cfg.cluster).bundles == ({"CPU": 1.0, "GPU": 1.0, "miles_trainer": 1.0},) * 2
    rollout = rollout_gang(cfg.rollout, cfg.cluster)
    assert rollout is not None and rollout.bundles == ({"CPU": 1.0, "GPU": 1.0, "miles_rollout": 1.0},) * 2
    # More engines than the rollout nodes hold: the rollout resource is what the error names.
    assert missing_resources(rollout, {"CPU": 8.0, "GPU": 8.0, "miles_rollout": 1.0}) == {"miles_rollout": 1.0}


def test_fit_problem_names_asked_and_available_in_one_line():
    from miles_lite.cluster.gang import GangSpec, fit_problem

    engines = GangSpec("rollout", ({"CPU": 1.0},) * 8)
    line = fit_problem(engines, {"CPU": 2.0, "memory": 1e9})
    assert line is not None and "\n" not in line
    assert line.startswith("the rollout gang (8 bundles) asks CPU 8; the cluster has CPU 2 in total;"), line
    assert fit_problem(GangSpec("rollout", ({"CPU": 1.0},) * 2), {"CPU": 2.0}) is None
    # What this job's trainer gang holds is not available to its rollout gang.
    line = fit_problem(GangSpec("rollout", ({"GPU": 1.0},) * 2), {"GPU": 4.0}, {"GPU": 3.0})
    assert line is not None and "asks GPU 2; the cluster has GPU 4 in total (GPU 3 of it held" in line
    # A role's custom resource that no node offers: can never fit.
    line = fit_problem(GangSpec("trainer", ({"CPU": 1.0, "miles_trainer": 1.0},)), {"CPU": 4.0})
    assert line is not None and "asks miles_trainer 1" in line and "miles_trainer 0 in total" in line
    # Enough in total, but no node holds one whole bundle.
    line = fit_problem(GangSpec("rollout", ({"GPU": 4.0},)), {"GPU": 4.0}, nodes=[{"GPU": 2.0}, {"GPU": 2.0}])
    assert line is not None and "one rollout bundle asks GPU 4; the largest node has GPU 2" in line
    # Enough of each resource in total and per bundle, but the role's resource pins both bundles to a node
    # whose GPUs hold only one (a Slurm trainer node with 2 GPUs, ranks of 2 GPUs each).
    trainer = GangSpec("trainer", ({"CPU": 1.0, "GPU": 2.0, "miles_trainer": 1.0},) * 2)
    nodes = [{"CPU": 2.0, "GPU": 2.0, "miles_trainer": 2.0}, {"CPU": 2.0, "GPU": 2.0, "miles_rollout": 2.0}]
    line = fit_problem(trainer, {"CPU": 4.0, "GPU": 4.0, "miles_trainer": 2.0, "miles_rollout": 2.0}, nodes=nodes)
    assert line is not None and "asks 2 bundles of CPU 1, GPU 2, miles_trainer 1; the cluster's nodes hold 1" in line
    one_node = {"CPU": 2.0, "GPU": 4.0, "miles_trainer": 2.0}
    assert fit_problem(trainer, one_node, nodes=[one_node]) is None
