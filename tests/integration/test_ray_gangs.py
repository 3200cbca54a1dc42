"""Gangs on a real local Ray instance with fake GPUs: all-or-nothing reservation and clear failures."""

from __future__ import annotations

import os
import time

import pytest

from miles_lite.cluster.gang import GangDoesNotFit, GangSchedulingError, GangSpec, reserve

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def local_ray():
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=2, num_gpus=4, include_dashboard=False, object_store_memory=100 * 1024**2,
             log_to_driver=False)
    yield
    ray.shutdown()


def test_gang_reserved_whole_and_actors_see_their_gpu(local_ray):
    from ray.util.placement_group import remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    spec = GangSpec("trainer", ({"CPU": 0.1, "GPU": 1.0},) * 2)
    pg = reserve(spec, timeout_s=30)

    @ray.remote(num_cpus=0.1, num_gpus=1)
    def gpu_ids():
        return ray.get_gpu_ids()

    ids = ray.get([gpu_ids.options(scheduling_strategy=PlacementGroupSchedulingStrategy(pg, i)).remote()
                   for i in range(2)])
    assert sorted(i[0] for i in ids) == sorted({i[0] for i in ids}) and all(len(i) == 1 for i in ids)
    remove_placement_group(pg)


def test_unschedulable_gang_fails_naming_missing_resources(local_ray):
    from ray.util.placement_group import remove_placement_group

    # It fits the cluster's total, but another gang holds 3 of the 4 GPUs until the timeout.
    other = reserve(GangSpec("trainer", ({"CPU": 0.1, "GPU": 3.0},)), timeout_s=30)
    try:
        spec = GangSpec("rollout", ({"CPU": 0.1, "GPU": 1.0},) * 2)
        with pytest.raises(GangSchedulingError) as info:
            reserve(spec, timeout_s=2)
        msg = str(info.value)
        assert "rollout gang" in msg and "missing {'GPU': 1.0}" in msg
    finally:
        remove_placement_group(other)
    # Nothing stays reserved after the failure: the full cluster is free again once the other gang's
    # removal (asynchronous in Ray) lands.
    deadline = time.monotonic() + 30
    while ray.available_resources().get("GPU") != 4.0:
        assert time.monotonic() < deadline, ray.available_resources()
        time.sleep(0.1)


def test_gang_larger_than_the_cluster_fails_at_once_with_asked_and_available(local_ray):
    # 8 engines of one CPU each on a 2-CPU cluster: no amount of waiting places them.
    spec = GangSpec("rollout", ({"CPU": 1.0},) * 8)
    started = time.monotonic()
    with pytest.raises(GangDoesNotFit) as info:
        reserve(spec, timeout_s=300)
    assert time.monotonic() - started < 10
    msg = str(info.value)
    assert "\n" not in msg and "asks CPU 8; the cluster has CPU 2 in total" in msg, msg
    assert "bundle_group" not in msg
    assert ray.available_resources().get("CPU") == 2.0
