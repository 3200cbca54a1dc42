"""Fault injection with real reference-engine processes: SIGKILL, a hanging engine, an engine answering 500.

One healthy engine server is shared by the module (started once); each test starts its own victim next to
it. Every rollout is 8 prompts x 4 samples and must come back complete, each sample slot filled once.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from miles_lite.config.schema import FaultToleranceConfig, RolloutConfig, TinyModelShape
from miles_lite.engines.fleet_launch import fleet_launcher
from miles_lite.engines.launcher import EngineLauncher, LaunchedEngine
from miles_lite.rollout.fleet import EngineFleet, EngineHandle, EngineState
from miles_lite.rollout.manager import RolloutManager
from miles_lite.trainer.tiny_hf import make_tiny_hf_model
from miles_lite.types import Group

PROMPTS = [(i, [5 + i, 17, 33, 2 * i + 1], None) for i in range(8)]
GROUP = 4
TOKENS = 24


def _rollout(**reference_args: object) -> RolloutConfig:
    return RolloutConfig(engines=2, group_size=GROUP, max_new_tokens=TOKENS, request_timeout_s=8.0,
                         max_inflight_per_engine=4, startup_timeout_s=180.0,
                         reference_args={"max_batch_size": 16, "threads": 1, **reference_args})


def _ft(**kw: float) -> FaultToleranceConfig:
    base = dict(health_interval_s=0.5, health_timeout_s=2.0, failure_threshold=2, max_engine_restarts=0,
                request_retries=3)
    base.update(kw)
    return FaultToleranceConfig(**base)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """Two tiny Qwen2 models with different weights: A is served at start, B is pushed later."""
    root = tmp_path_factory.mktemp("models")
    a = make_tiny_hf_model("qwen2", TinyModelShape(), 512, root / "a", seed=0)
    b = make_tiny_hf_model("qwen2", TinyModelShape(), 512, root / "b", seed=1)
    return str(a), str(b)


@pytest.fixture(scope="module")
def shared(models: tuple[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[LaunchedEngine]:
    """The healthy engine every test's fleet also holds (the fleet closes its client, not its server)."""
    launcher = EngineLauncher(_rollout(), models[0], str(tmp_path_factory.mktemp("logs-shared")))
    launched = asyncio.run(launcher.start(0))
    yield launched
    asyncio.run(launcher.stop(launched, grace_s=5.0))


def _assert_complete(groups: list[Group]) -> None:
    assert [g.prompt_index for g in groups] == list(range(8))
    for g in groups:
        assert len(g.samples) == GROUP
        assert len({tuple(s.response_ids) for s in g.samples}) == GROUP, "each sample is its own completion"
        for s in g.samples:
            assert len(s.response_ids) == len(s.rollout_logprobs) == TOKENS and s.finish_reason == "length"
            assert all(lp <= 0 for lp in s.rollout_logprobs)


async def _fleet_with_victim(shared: LaunchedEngine, victim_launcher: EngineLauncher, ft: FaultToleranceConfig,
                             replacement_launcher: EngineLauncher | None = None) -> EngineFleet:
    start_victim = fleet_launcher(victim_launcher, stop_grace_s=3.0)
    replace = fleet_launcher(replacement_launcher, stop_grace_s=3.0) if replacement_launcher else None

    async def launcher(index: int, incarnation: int) -> EngineHandle:
        assert replace is not None, "this test allows no replacement"
        return await replace(index, incarnation)

    fleet = EngineFleet(ft, launcher if replace else None, max_inflight_per_engine=4)
    await fleet.add_engine(EngineHandle(shared.client, stop=None, pid=shared.process.pid))
    await fleet.add_engine(await start_victim(1, 0))
    fleet.start_health_checks()
    return fleet


@pytest.mark.slow
def test_sigkill_mid_rollout_then_replace_and_admit_after_disk_push(
        shared: LaunchedEngine, models: tuple[str, str], tmp_path: Path) -> None:
    async def main() -> None:
        launcher = EngineLauncher(_rollout(), models[0], str(tmp_path / "logs"))
        fleet = await _fleet_with_victim(shared, launcher, _ft(max_engine_restarts=1), launcher)
        victim = fleet.records[1]
        pid = victim.handle.pid
        assert pid is not None and victim.engine_id == "reference-1"
        mgr = RolloutManager(fleet, _rollout(), fleet.cfg, seed=3)
        try:
            # As after a first push (version "0"): a replacement, starting from the checkpoint's version, is
            # stale (one reporting the fleet's version would be admitted at once).
            for rec in fleet.records:
                await rec.engine.update_weight_version("0")
                assert fleet.mark_synced(rec, "0")
            run = asyncio.ensure_future(mgr.generate_groups(PROMPTS))
            # Kill once the victim has served some requests and holds others: mid-rollout.
            assert await fleet.wait_for(lambda: victim.requests_served >= 2 and victim.inflight > 0, 60.0)
            os.kill(pid, signal.SIGKILL)
            groups = await asyncio.wait_for(run, 120.0)
            _assert_complete(groups)
            st = mgr.last_stats
            assert st.requests == 8 * GROUP, "one successful request per slot: nothing lost, nothing duplicated"
            assert st.retries >= 1 and set(st.engines_used) == {"reference-0", "reference-1"}
            assert fleet.stats()["retried_requests"] == st.retries

            assert await fleet.wait_for(lambda: victim.state is EngineState.STALE, 180.0), victim.last_error
            path = [t.new for t in fleet.transitions if t.slot == 1]
            assert path == [EngineState.HEALTHY, EngineState.DEAD, EngineState.REPLACING, EngineState.STALE]
            assert victim.handle.pid != pid and fleet.restarts == 1
            assert fleet.healthy_engines() == [shared.client]

            # A stale engine serves nothing: this rollout runs on the survivor alone.
            await mgr.generate_groups(PROMPTS[:2], group_size=2)
            assert set(mgr.last_stats.engines_used) == {"reference-0"}

            # The weight push (from disk): the survivor first, then the replacement is admitted.
            fleet.set_current_version("1")
            assert fleet.engines_needing_weights() == [shared.client, victim.engine]
            for engine in (shared.client, victim.engine):
                await engine.update_weights_from_disk(models[1], "1")
            assert fleet.mark_synced(shared.client, "1") and victim.state is EngineState.STALE
            assert fleet.mark_synced(victim.engine, "1")
            assert victim.state is EngineState.HEALTHY and fleet.engines_needing_weights() == []
            assert await victim.engine.weight_version() == "1"
            groups = await mgr.generate_groups(PROMPTS)
            _assert_complete(groups)
            assert {s.weight_version for g in groups for s in g.samples} == {"1"}
            assert set(mgr.last_stats.engines_used) == {"reference-0", "reference-1"}
        finally:
            await fleet.close()

    asyncio.run(main())


@pytest.mark.parametrize("mode", ["hang", "error"])
def test_faulty_engine_requests_are_retried_on_the_survivor(
        mode: str, shared: LaunchedEngine, models: tuple[str, str], tmp_path: Path) -> None:
    async def main() -> None:
        faulty = EngineLauncher(_rollout(fail_mode=mode, fail_after=2), models[0], str(tmp_path / "logs"))
        fleet = await _fleet_with_victim(shared, faulty, _ft())
        victim = fleet.records[1]
        mgr = RolloutManager(fleet, _rollout(request_timeout_s=4.0), fleet.cfg, seed=5)
        try:
            groups = await asyncio.wait_for(mgr.generate_groups(PROMPTS), 120.0)
            _assert_complete(groups)
            st = mgr.last_stats
            assert st.requests == 8 * GROUP and st.retries >= 1
            # The victim served only its first 2 /generate calls; each carries the samples started together on it,
            # at most max_inflight_per_engine (requests batched by the client).
            assert st.engines_used.get("reference-1", 0) <= 2 * 4, "the victim served only its first requests"
            assert victim.state is EngineState.DEAD
            # Declared dead by failed requests or by failed health checks, whichever came first.
            expected = ("TimeoutError", "health check") if mode == "hang" else ("HTTP 500", "health check")
            reasons = " ".join(t.reason for t in fleet.transitions if t.slot == 1) + victim.last_error
            assert any(e in reasons for e in expected), reasons
            assert fleet.stats()["failed_requests"] >= 1
            # The step finished with fewer engines; the next one runs on the survivor only.
            await mgr.generate_groups(PROMPTS[:2], group_size=2)
            assert set(mgr.last_stats.engines_used) == {"reference-0"}
        finally:
            await fleet.close()

    asyncio.run(main())


@pytest.mark.slow
def test_a_hung_engine_declared_dead_leaves_its_processes_stacks_beside_its_log(
        shared: LaunchedEngine, models: tuple[str, str], tmp_path: Path) -> None:
    """A hung engine's log says nothing of where it waits: before the fleet stops it, its processes' stacks
    (py-spy) go to `<engine>.<n>.stacks.txt` beside its log, taken while it still runs."""
    async def main() -> None:
        hung = EngineLauncher(_rollout(fail_mode="hang", fail_after=0), models[0], str(tmp_path / "logs"))
        fleet = await _fleet_with_victim(shared, hung, _ft())
        victim = fleet.records[1]
        pid = victim.handle.pid
        mgr = RolloutManager(fleet, _rollout(request_timeout_s=4.0), fleet.cfg, seed=5)
        try:
            groups = await asyncio.wait_for(mgr.generate_groups(PROMPTS[:2]), 120.0)
            assert [len(g.samples) for g in groups] == [GROUP, GROUP]
            assert await fleet.wait_for(lambda: victim.handle.stop is None, 90.0), "the dead engine was not stopped"
        finally:
            await fleet.close()
        [stacks] = (tmp_path / "logs").glob("*.stacks.txt")
        assert (stacks.parent / stacks.name.replace(".stacks.txt", ".log")).is_file()
        text = stacks.read_text()
        first = text.splitlines()[0]
        assert first.startswith("engine reference-1 (slot 1, start 0) declared dead: ") and "health check" in first
        [line] = [ln for ln in text.splitlines() if ln.startswith(f"pid {pid} ")]
        assert "(state S)" in line or "(state R)" in line, line  # alive when looked at
        assert f"==== pid {pid} " in text and "Python stacks" in text and "MainThread" in text, text

    asyncio.run(main())


def test_abort_mid_rollout_resumes_partials_under_new_weights(shared: LaunchedEngine, models: tuple[str, str]) -> None:
    async def main() -> None:
        fleet = EngineFleet(_ft(), max_inflight_per_engine=16)
        await fleet.add_engine(EngineHandle(shared.client, stop=None, pid=shared.process.pid))
        cfg = _rollout(max_inflight_per_engine=16)
        cfg.max_new_tokens = 200
        mgr = RolloutManager(fleet, cfg, fleet.cfg, seed=11)
        prompts = PROMPTS[:4]
        prompt_tokens = sum(len(p[1]) for p in prompts) * 2
        try:
            run = asyncio.ensure_future(mgr.generate_groups(prompts, group_size=2))

            async def decoded_some() -> bool:
                (load,) = await shared.client.load()
                return load["num_reqs"] == 8 and load["num_tokens"] >= prompt_tokens + 8 * 3

            deadline = asyncio.get_running_loop().time() + 60.0
            while not await decoded_some():  # poll the engine's own load report
                assert asyncio.get_running_loop().time() < deadline, "requests never started decoding"
                await asyncio.sleep(0.05)  # poll interval
            await mgr.abort(timeout_s=30.0)
            first = await run
            assert len(first) + mgr.pending_groups == 4 and mgr.last_stats.aborted
            old = await shared.client.weight_version()
            await shared.client.update_weights_from_disk(models[1], f"{old}-next")
            fleet.mark_synced(shared.client, f"{old}-next")
            resumed = await mgr.generate_groups([], group_size=2)
            assert mgr.pending_groups == 0 and len(first) + len(resumed) == 4
            samples = [s for g in resumed for s in g.samples]
            assert samples and all(len(s.response_ids) == len(s.rollout_logprobs) == 200 for s in samples)
            mixed = [s for s in samples if s.weight_version == f"{old}+{old}-next"]
            assert mixed and mgr.last_stats.resumed_partials == len(mixed)
        finally:
            await fleet.close()

    asyncio.run(main())


def test_start_fleet_gives_engines_their_own_environment(models: tuple[str, str], tmp_path: Path) -> None:
    """`rollout.engine_env` reaches the engine process (e.g. PYTHONPATH of a separate SGLang install)."""
    from dataclasses import replace

    from miles_lite.engines.fleet_launch import start_fleet

    rollout = replace(_rollout(), engine_env={"MILES_LITE_ENGINE_MARK": "engine-env-test"})

    async def start_and_read() -> bytes:
        fleet = await start_fleet(rollout, _ft(), models[0], str(tmp_path / "logs"), engines=1, health_checks=False)
        try:
            (record,) = fleet.records
            return Path(f"/proc/{record.handle.pid}/environ").read_bytes()
        finally:
            await fleet.close()

    environ = asyncio.run(start_and_read()).split(b"\0")
    assert b"MILES_LITE_ENGINE_MARK=engine-env-test" in environ
    assert any(e.startswith(b"PATH=") for e in environ)  # added to the inherited environment, not replacing it
