"""TP-aware weight sync from the real TP=2 trainer gang into real reference engines, through `System`.

`System.start` brings up what `miles-lite train` runs with `trainer.tp=2`: two Megatron ranks as Ray
actors (gloo between them), two reference-engine processes (TP=1 each) and the distributed transport
in shard mode (both trainer ranks join the weight-update group and send each engine rank only its
slices, gloo point-to-point). Every push must
leave each engine serving the trainer's weights bit for bit (every tensor read back with
`/get_weights_by_name`, compared with atol 0 against the trainer's own TP all-gather) and scoring
the probe like the trainer. Also: the disk transport, and a rebuilt group after an engine is killed
and its replacement admitted.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from trainer_scenarios import make_batch

from miles_lite.config.schema import MilesConfig
from miles_lite.config.validate import validate
from miles_lite.config.views import WeightSyncSetup
from miles_lite.rollout.engine_state import EngineState
from miles_lite.run.system import System
from miles_lite.weight_sync.disk import complete_versions
from miles_lite.weight_sync.factory import build_coordinator
from miles_lite.weight_sync.transport import EngineLoop

pytestmark = pytest.mark.slow
VOCAB = 512
# Megatron (fp32, TP=2) against transformers (fp32) on the probe: summation order only.
PROBE_TOL = 1e-4


def make_cfg(out: Path) -> MilesConfig:
    cfg = MilesConfig()
    cfg.experiment.output_dir = str(out)
    cfg.trainer.tp = 2
    cfg.trainer.device, cfg.trainer.layer_spec, cfg.trainer.precision = "cpu", "local", "fp32"
    cfg.trainer.lr = 1e-2
    cfg.rollout.engines = 2
    cfg.rollout.startup_timeout_s = 300.0
    cfg.rollout.reference_args = {"max_batch_size": 8}
    cfg.fault_tolerance.health_interval_s = 0.5
    cfg.fault_tolerance.max_engine_restarts = 1
    cfg.weight_sync.transport, cfg.weight_sync.mode = "distributed", "shard"
    cfg.weight_sync.max_probe_logp_diff = PROBE_TOL
    validate(cfg)
    return cfg


@pytest.fixture(scope="module")
def system(tmp_path_factory: pytest.TempPathFactory) -> Iterator[System]:
    pytest.importorskip("ray")
    root = tmp_path_factory.mktemp("wsync_trainer")
    run_dir = root / "run"
    run_dir.mkdir()
    with System.start(make_cfg(root), run_dir) as live:
        yield live


def serving(system: System) -> list:
    assert system.fleet is not None
    return [r for r in system.fleet.records if r.state is EngineState.HEALTHY]


def train_and_push(system: System, seed: int):
    """One RL step (so the weights move), then a push; returns the report and the trainer's HF tensors."""
    stats = system.trainer.train_step(make_batch(VOCAB, n=4, seed=seed))
    assert stats["skipped"] == 0.0
    report, _ = system.push_weights(system.version + 1)
    return report, system.trainer.export_hf_state_dict()


def assert_engines_hold(system: System, records: list, expected: dict[str, torch.Tensor]) -> None:
    """Every tensor of every engine equals the trainer's, bit for bit."""
    assert system.loop_thread is not None
    for rec in records:
        for name, tensor in expected.items():
            rows = system.loop_thread.run(rec.engine.get_weights_by_name(name, tensor.shape[0]))
            assert torch.equal(torch.tensor(rows, dtype=tensor.dtype), tensor), (rec.engine_id, name)


def test_shard_push_from_tp2_trainer_is_bit_exact(system: System) -> None:
    initial = system.trainer.export_hf_state_dict()
    report, trained = train_and_push(system, seed=1)
    assert report.push.transport == "distributed/shard"
    assert report.push.engines == tuple(r.engine_id for r in serving(system)) and len(report.push.engines) == 2
    # TP=1 engines receive every element once: the full model per engine.
    full_bytes = sum(t.numel() * t.element_size() for t in trained.values())
    assert report.push.bytes == 2 * full_bytes
    # The trainer ranks send their own slices: nothing is gathered into the driver, and every engine
    # receives from both trainer ranks.
    assert report.push.seconds["gather"] == 0.0 and report.push.seconds["transfer"] > 0
    transport = system.sync.transport
    assert all({p.dst for p in schedule.sends} == set(transport.rank_offsets.values())
               for schedule in transport.schedules[0])
    assert report.verify is not None and report.verify.logp_diff_mean < PROBE_TOL
    assert any(not torch.equal(trained[n], initial[n]) for n in trained)
    assert_engines_hold(system, serving(system), trained)
    versions = {system.loop_thread.run(r.engine.weight_version()) for r in serving(system)}
    assert versions == {str(system.version)}


def test_disk_push_from_tp2_trainer(system: System) -> None:
    cfg = dataclasses.replace(system.cfg, weight_sync=dataclasses.replace(system.cfg.weight_sync, transport="disk",
                                                                          bucket_mib=1))
    distributed = system.sync
    assert system.loop_thread is not None and system.pusher is not None
    # The push goes through the fleet pusher: it gets the disk coordinator for this one push.
    system.sync = system.pusher.sync = build_coordinator(WeightSyncSetup.of(cfg), system.trainer,
                                                         EngineLoop(system.loop_thread.loop), system.run_dir)
    try:
        report, trained = train_and_push(system, seed=2)
    finally:
        system.sync.close()
        system.sync = system.pusher.sync = distributed
    assert report.push.transport == "disk" and report.verify is not None
    assert report.verify.logp_diff_mean < PROBE_TOL
    assert [p.name for p in complete_versions(system.run_dir / "weights")] == [f"v{system.version}"]
    assert_engines_hold(system, serving(system), trained)


def test_push_rebuilds_the_group_after_an_engine_is_replaced(system: System) -> None:
    assert system.fleet is not None and system.sync is not None
    train_and_push(system, seed=3)
    generation = system.sync.transport.generation
    victim = system.fleet.records[1]
    os.kill(victim.handle.pid, signal.SIGKILL)
    deadline = time.monotonic() + 300
    # The health checks find it dead and start a replacement, admitted stale (it serves the initial weights).
    while not (victim.incarnation == 1 and victim.state is EngineState.STALE):
        assert time.monotonic() < deadline, f"no stale replacement within 300 s: {victim.state}, {victim.last_error}"
        time.sleep(0.2)
    report, trained = train_and_push(system, seed=4)
    assert system.sync.transport.generation == generation + 1
    assert report.push.engines == ("reference-0", "reference-1.1")
    assert report.verify is not None and report.verify.logp_diff_mean < PROBE_TOL
    assert victim.state is EngineState.HEALTHY and victim.version == str(system.version)
    assert_engines_hold(system, serving(system), trained)
