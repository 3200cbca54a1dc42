"""A weight push that meets an engine killed since its last health check: the run's `System` (real CPU
trainer, two reference-engine processes, the distributed transport over gloo) drops the dead engine
from the push, pushes to the survivor, and the fleet replaces the dead one, admitted at the next push."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from miles_lite.config import load_config, validate
from miles_lite.rollout.engine_state import EngineState
from miles_lite.run.system import System

pytestmark = pytest.mark.slow


def test_a_push_skips_an_engine_killed_just_before_it(tmp_path: Path) -> None:
    # Health checks every 60 s: the push, not a check, is the first to meet the dead engine.
    cfg = load_config(["rollout.engines=2", "fault_tolerance.health_interval_s=60",
                       "fault_tolerance.max_engine_restarts=1", f"experiment.output_dir={tmp_path}"])
    validate(cfg)
    with System.start(cfg, tmp_path / "run") as system:
        assert system.fleet is not None and system.loop_thread is not None
        system.push_weights(system.version + 1)
        victim, survivor = system.fleet.records
        assert victim.handle.pid is not None
        os.kill(victim.handle.pid, signal.SIGKILL)
        os.waitpid(victim.handle.pid, 0)  # gone for sure before the push starts

        report, _ = system.push_weights(system.version + 1)
        assert report.push.engines == (survivor.engine_id,)
        assert report.verify is not None and set(report.verify.engines) == {survivor.engine_id}
        assert survivor.state is EngineState.HEALTHY and survivor.version == str(system.version)
        reasons = [t.reason for t in system.fleet.transitions if t.slot == victim.index]
        assert any("after a failed weight push" in r for r in reasons), reasons

        deadline = time.monotonic() + 180
        while victim.state is not EngineState.STALE and time.monotonic() < deadline:
            time.sleep(0.2)
        assert victim.state is EngineState.STALE, victim.last_error
        report, _ = system.push_weights(system.version + 1)
        assert len(report.push.engines) == 2
        assert victim.state is EngineState.HEALTHY and victim.incarnation == 1


def test_a_push_that_finds_the_only_engine_dead_leaves_its_version_for_the_replacement(tmp_path: Path) -> None:
    """No engine left to push to: the push reports none and raises nothing; the replacement comes up stale,
    and the starved fleet's relief (`System.refresh_stale`) brings it to that version, probe-verified."""
    cfg = load_config(["rollout.engines=1", "fault_tolerance.health_interval_s=60",
                       "fault_tolerance.max_engine_restarts=1", f"experiment.output_dir={tmp_path}"])
    validate(cfg)
    with System.start(cfg, tmp_path / "run") as system:
        assert system.fleet is not None and system.loop_thread is not None
        assert system.refresh_stale() is None, "nothing pushed yet: no relief"
        system.push_weights(system.version + 1)
        (only,) = system.fleet.records
        assert only.handle.pid is not None
        os.kill(only.handle.pid, signal.SIGKILL)
        os.waitpid(only.handle.pid, 0)

        report, _ = system.push_weights(system.version + 1)
        assert report.push.engines == () and report.verify is None
        assert system.fleet.current_version == str(system.version) == "2"
        deadline = time.monotonic() + 180
        while only.state is not EngineState.STALE and time.monotonic() < deadline:
            time.sleep(0.2)
        assert only.state is EngineState.STALE and only.incarnation == 1, only.last_error
        assert system.fleet.starved()
        relief = system.refresh_stale()
        assert relief is not None and relief.push.engines == (f"{only.engine_id}.1",)
        assert relief.verify is not None and relief.verify.logp_diff_mean < 1e-3
        assert only.state is EngineState.HEALTHY and only.version == "2"
        assert system.refresh_stale() is None, "an engine serves again: nothing to relieve"
