"""Engines started elsewhere: `miles-lite engine` rebuilds the job's tiny model from the same overrides the
trainer gets, and a fleet attached by URL (`rollout.engine_urls`) serves rollouts from it."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from miles_lite.config import load_config, validate
from miles_lite.engines.fleet_launch import attach_fleet
from miles_lite.net.api_key import new_key, read_key_file, write_key_file
from miles_lite.net.ports import LOCAL_HOST, free_port
from miles_lite.rollout.engine_state import EngineState
from miles_lite.rollout.process import EngineProcess
from miles_lite.rollout.sync_api import EventLoopThread
from miles_lite.run.model_assets import prepare_model
from miles_lite.run.system import System
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


def _engine_at(port: int, tmp_path: Path, name: str, overrides: list[str], key_file: Path) -> EngineProcess:
    """`miles-lite engine` on a fixed port (a pod behind its Service) asking for the job's key (a mounted
    Secret's file), once it answers `/health_generate`."""

    def command(port: int, fd: int | None) -> list[str]:
        return [sys.executable, "-m", "miles_lite.cli", "engine", "--host", LOCAL_HOST, "--port", str(port),
                "--api-key-file", str(key_file), "--model-dir", str(tmp_path / f"{name}-model"), *overrides]

    server = EngineProcess(name, command, str(tmp_path / f"{name}.log"), port=port,
                           api_key=read_key_file(key_file))
    server.start()
    server.wait_ready(240)
    return server


def test_an_attached_engine_restarted_between_health_checks_is_left_out_of_the_push_and_readmitted(tmp_path: Path):
    # A killed engine pod is recreated under its Service name before any health check fails (checks every
    # 60 s here): the next push meets a new process at the old address, serving its initial weights and in
    # no weight-update group. The run must go on without it, then re-admit it after a push.
    # The job's key: the engines ask for it, the run sends it and presents it to the weight-update group.
    key_file = write_key_file(tmp_path / "api-key", new_key())
    overrides = [f"experiment.output_dir={tmp_path}"]
    ports = [free_port(LOCAL_HOST), free_port(LOCAL_HOST)]
    procs = [_engine_at(p, tmp_path, f"engine-{i}", overrides, key_file) for i, p in enumerate(ports)]
    try:
        urls = ",".join(f"http://{LOCAL_HOST}:{p}" for p in ports)
        cfg = load_config([*overrides, f"cluster.api_key_file={key_file}", f"rollout.engine_urls=[{urls}]",
                           "fault_tolerance.health_interval_s=60", "fault_tolerance.max_engine_restarts=1"])
        validate(cfg)
        with System.start(cfg, tmp_path / "run") as system:
            assert system.fleet is not None
            system.push_weights(system.version + 1)
            survivor, victim = system.fleet.records
            os.killpg(procs[1].pid, signal.SIGKILL)  # the pod dies without a word (its new server binds the
            procs[1].stop()                          # port seconds later, after its imports)
            procs[1] = _engine_at(ports[1], tmp_path, "engine-1-new", overrides, key_file)

            report, _ = system.push_weights(system.version + 1)
            assert report.push.engines == (survivor.engine_id,)
            assert report.verify is not None and set(report.verify.engines) == {survivor.engine_id}
            reasons = [t.reason for t in system.fleet.transitions if t.slot == victim.index]
            assert any("restarted behind the fleet" in r and "served '1'" in r for r in reasons), reasons

            deadline = time.monotonic() + 60
            while victim.state is not EngineState.STALE and time.monotonic() < deadline:
                time.sleep(0.2)
            assert victim.state is EngineState.STALE and victim.incarnation == 1, victim.last_error
            report, _ = system.push_weights(system.version + 1)
            assert len(report.push.engines) == 2 and victim.state is EngineState.HEALTHY
            assert report.verify is not None and report.verify.logp_diff_mean < 1e-3
    finally:
        for proc in procs:
            proc.stop()


def test_a_running_system_follows_its_engine_list(tmp_path: Path):
    # The operator's scaling edit, seen from the trainer: the engine list file gains an engine (admitted stale,
    # healthy after the next push, which re-forms the weight-update group with it), then loses it again (retired:
    # no request, push or replacement, not counted as a restart). The trainer runs on throughout.
    key_file = write_key_file(tmp_path / "api-key", new_key())
    overrides = [f"experiment.output_dir={tmp_path}"]
    ports = [free_port(LOCAL_HOST), free_port(LOCAL_HOST)]
    urls = [f"http://{LOCAL_HOST}:{p}" for p in ports]
    procs = [_engine_at(p, tmp_path, f"engine-{i}", overrides, key_file) for i, p in enumerate(ports)]
    listing = tmp_path / "engines"
    listing.write_text(f"{urls[0]}\n")
    try:
        cfg = load_config([*overrides, f"cluster.api_key_file={key_file}", f"rollout.engine_urls=[{urls[0]}]",
                           "rollout.engines=1",
                           f"rollout.engine_urls_file={listing}", "fault_tolerance.health_interval_s=0.5"])
        validate(cfg)
        with System.start(cfg, tmp_path / "run") as system:
            fleet = system.fleet
            assert fleet is not None
            system.push_weights(system.version + 1)
            listing.write_text(f"{urls[0]}\n{urls[1]}\n")
            deadline = time.monotonic() + 120
            # Admission lists the engine as starting first, then stale once its health and version are read.
            while ((len(fleet.records) < 2 or fleet.records[1].state is EngineState.STARTING)
                   and time.monotonic() < deadline):
                time.sleep(0.2)
            first, added = fleet.records
            assert added.engine_id == "engine-1" and added.state is EngineState.STALE, added.state
            report, _ = system.push_weights(system.version + 1)
            assert set(report.push.engines) == {"engine-0", "engine-1"} and added.state is EngineState.HEALTHY
            assert report.verify is not None and report.verify.logp_diff_mean < 1e-3

            listing.write_text(f"{urls[0]}\n")
            deadline = time.monotonic() + 30
            while added.state is not EngineState.RETIRED and time.monotonic() < deadline:
                time.sleep(0.2)
            assert added.state is EngineState.RETIRED and fleet.restarts == 0
            report, _ = system.push_weights(system.version + 1)
            assert report.push.engines == ("engine-0",) and first.state is EngineState.HEALTHY
            assert procs[1].alive()  # removed from this job's fleet, not stopped by it (the operator deletes the pod)
    finally:
        for proc in procs:
            proc.stop()
