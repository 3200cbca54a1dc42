"""Gang specs: bundles per role from the configuration, and the missing-resource arithmetic."""

from miles_lite.cluster.gang import missing_resources, rollout_gang, trainer_gang
from miles_lite.config import load_config


def test_disaggregated_roles_get_separate_bundles():
    cfg = load_config(["cluster=ray", "trainer.tp=2", "trainer.dp=2", "rollout.engines=3", "rollout.engine_tp=2"])
    trainer, rollout = trainer_gang(cfg), rollout_gang(cfg)
    assert len(trainer.bundles) == 4 and trainer.total() == {"CPU": 4.0, "GPU": 4.0}
    assert rollout is not None and len(rollout.bundles) == 3
    assert rollout.bundles[0] == {"CPU": 1.0, "GPU": 2.0}


def test_colocated_engines_share_trainer_bundles():
    cfg = load_config(["cluster=ray_colocated", "trainer.tp=2", "rollout.engines=2"])
    assert rollout_gang(cfg) is None
    assert trainer_gang(cfg).bundles == ({"CPU": 2.0, "GPU": 1.0}, {"CPU": 2.0, "GPU": 1.0})


def test_missing_resources_names_what_is_short():
    cfg = load_config(["cluster=ray", "rollout.engines=4"])
    spec = rollout_gang(cfg)
    assert spec is not None
    assert missing_resources(spec, {"CPU": 8.0, "GPU": 2.0}) == {"GPU": 2.0}
    assert missing_resources(spec, {"CPU": 8.0, "GPU": 4.0}) == {}


def test_role_resources_pin_each_bundle_to_its_role_nodes():
    cfg = load_config(["cluster=ray", "trainer.tp=2", "rollout.engines=2", "cluster.trainer_resource=miles_trainer",
                       "cluster.rollout_resource=miles_rollout"])
    assert trainer_gang(cfg).bundles == ({"CPU": 1.0, "GPU": 1.0, "miles_trainer": 1.0},) * 2
    rollout = rollout_gang(cfg)
    assert rollout is not None and rollout.bundles == ({"CPU": 1.0, "GPU": 1.0, "miles_rollout": 1.0},) * 2
    # More engines than the rollout nodes hold: the rollout resource is what the error names.
    assert missing_resources(rollout, {"CPU": 8.0, "GPU": 8.0, "miles_rollout": 1.0}) == {"miles_rollout": 1.0}
