"""Engines started elsewhere: `miles-lite engine` rebuilds the job's tiny model from the same overrides the
trainer gets, and a fleet attached by URL (`rollout.engine_urls`) serves rollouts from it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from miles_lite.config import load_config
from miles_lite.engines.fleet_launch import attach_fleet
from miles_lite.model_assets import prepare_model
from miles_lite.rollout.process import EngineProcess
from miles_lite.rollout.sync_api import EventLoopThread
from miles_lite.types import SamplingParams

pytestmark = pytest.mark.slow


def test_engine_cli_builds_the_jobs_model_and_a_fleet_attaches_by_url(tmp_path: Path):
    overrides = [f"experiment.output_dir={tmp_path}"]

    def command(port: int, fd: int | None) -> list[str]:
        return [sys.executable, "-m", "miles_lite.cli", "engine", "--host", "127.0.0.1", "--port", str(port),
                "--model-dir", str(tmp_path / "engine-model"), *overrides]

    server = EngineProcess("external-0", command, str(tmp_path / "engine.log"))
    server.start()
    try:
        server.wait_ready(240)
        # The trainer side prepares the same seeded model: identical weights on both sides.
        cfg, _ = prepare_model(load_config(overrides), tmp_path / "trainer-side")
        engine_cfg, _ = prepare_model(load_config(overrides), tmp_path / "engine-model")
        trainer_bytes = (Path(cfg.model.hf_path) / "model.safetensors").read_bytes()
        assert trainer_bytes == (Path(engine_cfg.model.hf_path) / "model.safetensors").read_bytes()

        cfg.rollout.engine_urls = [server.url]
        with EventLoopThread() as loop:
            fleet = loop.run(attach_fleet(cfg.rollout, cfg.fault_tolerance, list(cfg.rollout.engine_urls)))
            try:
                assert [r.engine_id for r in fleet.records] == ["engine-0"]
                engine = fleet.healthy_engines()[0]
                gen = loop.run(engine.generate([1, 2, 3], SamplingParams(max_new_tokens=4, temperature=0.0,
                                                                         ignore_eos=True)))
                assert len(gen.output_ids) == 4 and len(gen.output_logprobs) == 4
            finally:
                loop.run(fleet.close())
        assert server.alive()  # the fleet does not own external engines
    finally:
        server.stop()
