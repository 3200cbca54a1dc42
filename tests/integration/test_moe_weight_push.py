"""Weight pushes of a Qwen3-MoE from a trainer with tensor and expert parallelism into reference engines.

Two CPU ranks (gloo) in three layouts: `trainer.ep=2` with data parallelism (experts 4..7 live on the second
data-parallel rank, which sends them as a sender beyond the TP ranks), `trainer.tp=2` (attention and the dense
MLP resharded by TP, every expert whole on both ranks, sent by TP rank 0) and `trainer.ep=2` with
`trainer.tp=2` (experts 4..7 on TP rank 1). Every transport that runs on CPU (distributed shard and full,
disk; the IPC ones need CUDA) pushes, and every engine then holds the trainer's HF export bit for bit
(`/get_weights_by_name`, atol 0) and scores the probe like the trainer. The `miles-lite train` runs push after
each step with the probe verification on, which fails the run on a mismatch.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from trainer_scenarios import make_batch

from miles_lite.config.compose import load_config
from miles_lite.config.validate import validate
from miles_lite.config.views import WeightSyncSetup
from miles_lite.rollout.engine_state import EngineState
from miles_lite.run.system import System
from miles_lite.weight_sync.factory import build_coordinator
from miles_lite.weight_sync.transport import EngineLoop

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]
VOCAB = 512
# Megatron (fp32) against transformers (fp32) on the probe: summation order only.
PROBE_TOL = 1e-4
# name -> (trainer overrides, engines, engine TP)
LAYOUTS = {"ep2_dp2": (["trainer.dp=2", "trainer.ep=2"], 2, 1),
           "ep2_tp2": (["trainer.tp=2", "trainer.ep=2"], 1, 2)}


def moe_system_cfg(out: Path, layout: str):
    overrides, engines, engine_tp = LAYOUTS[layout]
    cfg = load_config(["model=tiny_qwen3_moe", *overrides, f"experiment.output_dir={out}",
                       "trainer.device=cpu", "trainer.layer_spec=local", "trainer.precision=fp32", "trainer.lr=1e-2",
                       "trainer.lr_warmup_steps=0",
                       f"rollout.engines={engines}", f"rollout.engine_tp={engine_tp}",
                       "rollout.startup_timeout_s=300", "weight_sync.transport=distributed", "weight_sync.mode=shard",
                       f"weight_sync.max_probe_logp_diff={PROBE_TOL}", "weight_sync.init_timeout_s=60",
                       "observability.metrics_enabled=false"])
    validate(cfg)
    return cfg


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def system(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[System]:
    pytest.importorskip("ray")
    root = tmp_path_factory.mktemp(f"moe_push_{request.param}")
    run_dir = root / "run"
    run_dir.mkdir()
    with System.start(moe_system_cfg(root, request.param), run_dir) as live:
        yield live


def serving(system: System) -> list:
    assert system.fleet is not None
    return [r for r in system.fleet.records if r.state is EngineState.HEALTHY]


def assert_engines_hold(system: System, expected: dict[str, torch.Tensor]) -> None:
    """Every tensor of every engine equals the trainer's HF export, bit for bit."""
    assert system.loop_thread is not None
    experts = [n for n in expected if ".mlp.experts." in n]
    assert len(experts) == 2 * 8 * 3  # layers 1 and 2 (layer 0 is dense), 8 experts, gate/up/down
    assert "model.layers.1.mlp.gate.weight" in expected
    for rec in serving(system):
        for name, tensor in expected.items():
            rows = system.loop_thread.run(rec.engine.get_weights_by_name(name, tensor.shape[0]))
            assert torch.equal(torch.tensor(rows, dtype=tensor.dtype), tensor), (rec.engine_id, name)


@pytest.mark.parametrize("transport,mode", [("distributed", "shard"), ("distributed", "full"), ("disk", "shard")])
def test_push_from_tp_and_ep_ranks_is_bit_exact(system: System, transport: str, mode: str, tmp_path: Path) -> None:
    cfg = dataclasses.replace(system.cfg, weight_sync=dataclasses.replace(
        system.cfg.weight_sync, transport=transport, mode=mode, disk_dir=str(tmp_path / "weights")))
    assert system.loop_thread is not None and system.pusher is not None and system.sync is not None
    # One weight-update group per engine at a time: the system's own leaves before this transport's forms (the
    # system closes whichever coordinator it holds last).
    system.sync.close()
    system.sync = system.pusher.sync = build_coordinator(WeightSyncSetup.of(cfg), system.trainer,
                                                         EngineLoop(system.loop_thread.loop), system.run_dir,
                                                         system.api_key.value)
    before = system.trainer.export_hf_state_dict()
    stats = system.trainer.train_step(make_batch(VOCAB, n=4, seed=len(transport + mode)))
    assert stats["skipped"] == 0.0
    report, _ = system.push_weights(system.version + 1)
    trained = system.trainer.export_hf_state_dict()
    assert report.push.transport == (f"distributed/{mode}" if transport == "distributed" else "disk")
    assert report.verify is not None and report.verify.logp_diff_max < PROBE_TOL
    # The step moved experts of both EP halves (their gradients reached the push).
    moved = {int(n.split(".")[5]) for n in trained if ".experts." in n and not torch.equal(trained[n], before[n])}
    assert moved & {0, 1, 2, 3} and moved & {4, 5, 6, 7}, moved
    assert_engines_hold(system, trained)
    versions = {system.loop_thread.run(r.engine.weight_version()) for r in serving(system)}
    assert versions == {str(system.version)}


# name -> trainer overrides and the transport the run pushes with.
CLI_RUNS = {"ep2_dp2_shard": ["trainer.dp=2", "trainer.ep=2"],
            "tp2_disk": ["trainer.tp=2", "weight_sync.transport=disk"],
            "ep2_tp2_full": ["trainer.tp=2", "trainer.ep=2", "weight_sync.mode=full"]}


@pytest.mark.parametrize("run", sorted(CLI_RUNS))
def test_moe_train_cli_pushes_verified(run: str, tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "miles_lite.cli", "train", "model=tiny_qwen3_moe", *CLI_RUNS[run],
           "trainer.precision=fp32", "experiment.warmup=none", "experiment.steps=2", "algo.drop_zero_signal=false",
           "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=8",
           "data.synthetic.eval_size=4", f"weight_sync.max_probe_logp_diff={PROBE_TOL}",
           f"experiment.output_dir={tmp_path}", "experiment.run_name=run", "observability.progress=false",
           "observability.metrics_enabled=false"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2]
    for stats in steps:
        # A push after every step, verified (a probe diff over the limit would have failed the run).
        assert stats["sync/probe_logp_diff_max"] < PROBE_TOL
        assert stats["sync/bytes"] > 0
        assert stats["moe/router_agreement"] > 0.9
