"""`benchmarks/rollout_throughput.py` on an in-process engine: a pass the engine fails is recorded (with the
engine's processes described) and the benchmark goes on until `--repeats` rounds are complete; a failed health
check during a pass takes the engine's stacks with py-spy; the JSON report is rewritten after every round; the
summary counts complete rounds only; `scripts/gpu_summary.py` reads the report."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fake_rollout_engine import FakeEngine

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO / "scripts"))

import engine_processes  # noqa: E402
import rollout_throughput as bench  # noqa: E402
from gpu_summary import rollout_table  # noqa: E402

from miles_lite.config.schema import FaultToleranceConfig, RolloutConfig  # noqa: E402
from miles_lite.rollout.engine import EngineError  # noqa: E402
from miles_lite.rollout.fleet import EngineFleet, EngineHandle  # noqa: E402
from miles_lite.types import SamplingParams  # noqa: E402

GROUP = 4


class FlakyEngine(FakeEngine):
    """A fake engine whose `/generate` calls numbered in `fail_calls` (from 1) raise EngineError as the HTTP client
    does when the server drops the connection; `on_fail` runs first (to look at the report at that moment)."""

    def __init__(self, fail_calls: set[int], on_fail: Any = None) -> None:
        super().__init__("sglang-0")
        self.fail_calls = fail_calls
        self.on_fail = on_fail
        self.generated = 0

    async def generate(self, input_ids: list[int], sampling: SamplingParams, *, rid: str | None = None) -> Any:
        self.generated += 1
        if self.generated in self.fail_calls:
            if self.on_fail is not None:
                self.on_fail()
            raise EngineError("sglang-0 /generate: ServerDisconnectedError: Server disconnected")
        return await super().generate(input_ids, sampling, rid=rid)


@pytest.fixture
def engine_group() -> Iterator[int]:
    """The pid of a process in a session (and process group) of its own, as the launcher starts an engine."""
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE,
                            start_new_session=True)
    try:
        yield proc.pid
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(timeout=30)


def _args(out: Path, requests: str = "4,8", repeats: int = 3) -> argparse.Namespace:
    return argparse.Namespace(backend="reference", requests=requests, variants="shipped", prompt_len=3, new_tokens=2,
                              group_size=GROUP, repeats=repeats, vocab=50, startup_timeout=10.0, out=str(out))


def _measure(monkeypatch: pytest.MonkeyPatch, engine: FakeEngine, pid: int, args: argparse.Namespace,
             health: FaultToleranceConfig | None = None) -> dict[str, Any]:
    """The benchmark on `engine` (its process: `pid`); `health`: the fleet's health checks run with these."""
    async def start_fleet(rollout: RolloutConfig, ft: FaultToleranceConfig, model_dir: str, log_dir: str,
                          engines: int) -> EngineFleet:
        fleet = EngineFleet(health or ft)
        await fleet.add_engine(EngineHandle(engine, pid=pid))
        if health is not None:
            fleet.start_health_checks()
        return fleet

    monkeypatch.setattr(bench, "start_fleet", start_fleet)
    return asyncio.run(bench.measure(args, "/no/model", "/no/logs"))


def test_a_failed_pass_is_recorded_and_the_rounds_go_on(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                         engine_group: int, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "rollout.json"
    seen: list[dict[str, Any]] = []
    # At 4 requests: the warm-up is calls 1-4, round 1 calls 5-12 (direct, manager); call 13 is round 2's direct.
    engine = FlakyEngine({13}, on_fail=lambda: seen.append(json.loads(out.read_text())))
    report = _measure(monkeypatch, engine, engine_group, _args(out))

    # The report on disk when the pass failed already held round 1.
    assert [(r["round"], r["mode"]) for r in seen[0]["variants"][0]["runs"]] == [(1, "direct"), (1, "manager")]
    assert seen[0]["rows"][0]["rounds"] == 1
    var = report["variants"][0]
    [failure] = var["failures"]
    assert (failure["variant"], failure["requests"], failure["round"], failure["mode"]) == ("shipped", 4, 2, "direct")
    assert "ServerDisconnectedError" in failure["error"] and failure["after_s"] >= 0
    assert failure["recovered_s"] is not None
    # The engine's process group and this process, with their descriptors and open-files limits.
    roles = {(p["role"], p["pid"]) for p in failure["processes"]}
    assert roles == {("engine", engine_group), ("benchmark", os.getpid())}
    for p in failure["processes"]:
        assert p["fds"] >= 3 and p["sockets"] is not None and p["command"]
        assert len(p["max_open_files"]) == 2
    # Round 2 is incomplete: rounds 1, 3 and 4 make the 3 complete rounds at 4 requests; rounds 1-3 at 8.
    rows = {r["requests"]: r for r in report["rows"]}
    assert (rows[4]["rounds"], rows[4]["failures"], rows[8]["rounds"], rows[8]["failures"]) == (3, 1, 3, 0)
    assert {(r["requests"], r["round"], r["mode"]) for r in var["runs"] if r["requests"] == 4} == {
        (4, 1, "direct"), (4, 1, "manager"), (4, 3, "direct"), (4, 3, "manager"), (4, 4, "direct"), (4, 4, "manager")}
    assert {r["round"] for r in var["runs"] if r["requests"] == 8} == {1, 2, 3}
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    printed = capsys.readouterr().out
    assert "  shipped        direct      4 requests: FAILED in round 2 after" in printed
    assert f"engine    pid {engine_group} " in printed and f"benchmark pid {os.getpid()} " in printed
    # The per-pass lines other scripts read are as they were.
    assert any(line.startswith("  shipped        manager     8 requests: ") and line.endswith(" s)")
               and " tok/s (" in line for line in printed.splitlines())


def test_a_size_is_given_up_after_three_failed_passes(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                     engine_group: int) -> None:
    out = tmp_path / "rollout.json"
    # 4 requests: the warm-up and rounds 1-2's direct passes fail (calls 1, 5, 9), so rounds 3-5 never run.
    engine = FlakyEngine({1, 5, 9})
    report = _measure(monkeypatch, engine, engine_group, _args(out, repeats=5))
    var = report["variants"][0]
    assert [(f["requests"], f["round"], f["mode"]) for f in var["failures"]] == [
        (4, 0, "direct"), (4, 1, "direct"), (4, 2, "direct")]
    assert var["given_up"] == [{"requests": 4, "reason": "3 failed passes"}]
    rows = {r["requests"]: r for r in report["rows"]}
    assert rows[4]["rounds"] == 0 and rows[4]["given_up"] == "3 failed passes" and "direct_tok_s" not in rows[4]
    assert rows[8]["rounds"] == 5 and rows[8]["failures"] == 0  # the next size ran in full
    table = rollout_table(tmp_path)
    assert table[2] == "| shipped | 4 | 0/5, 3 failed passes | - | - | - |"
    assert table[3].startswith("| shipped | 8 | 5/5 |")


def test_an_engine_that_stops_answering_ends_the_variant(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                         engine_group: int) -> None:
    out = tmp_path / "rollout.json"
    engine = FlakyEngine({5})  # round 1's direct pass at 4 requests

    def stop_answering() -> None:
        engine.healthy = False

    engine.on_fail = stop_answering
    monkeypatch.setattr(bench, "RECOVERY_S", 0.2)
    report = _measure(monkeypatch, engine, engine_group, _args(out))
    var = report["variants"][0]
    [failure] = var["failures"]
    assert failure["recovered_s"] is None and var["runs"] == []
    assert [g["requests"] for g in var["given_up"]] == [4, 8]
    assert json.loads(out.read_text())["variants"][0]["given_up"] == var["given_up"]


class StallingEngine(FakeEngine):
    """A fake engine whose `/generate` calls numbered in `stall_calls` (from 1) wait until `released` exists (the
    fake py-spy writes it), its health check answering unhealthy once meanwhile: a scheduler gone silent."""

    def __init__(self, stall_calls: set[int], released: Path) -> None:
        super().__init__("sglang-0")
        self.stall_calls, self.released_file = stall_calls, released
        self.generated, self.stalled, self.failed_checks = 0, 0, 0

    async def generate(self, input_ids: list[int], sampling: SamplingParams, *, rid: str | None = None) -> Any:
        self.generated += 1
        if self.generated in self.stall_calls:
            self.stalled += 1
            for _ in range(600):  # the stall lasts until the stacks were taken
                if self.released_file.exists():
                    break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError("no stacks were taken within 30 s of the stall")
            self.stalled -= 1
        return await super().generate(input_ids, sampling, rid=rid)

    async def health(self, timeout_s: float) -> bool:
        if self.stalled and not self.failed_checks:
            self.failed_checks += 1
            return False
        return await super().health(timeout_s)


def test_a_failed_health_check_mid_pass_takes_the_engines_stacks(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                                 engine_group: int) -> None:
    out, calls, released = tmp_path / "rollout.json", tmp_path / "py-spy-calls", tmp_path / "released"
    py_spy = tmp_path / "bin" / "py-spy"
    py_spy.parent.mkdir()
    py_spy.write_text(f'#!/bin/sh\necho "$*" >> {calls}\n: > {released}\n'
                      'echo "Thread 7 (idle): \\"MainThread\\""\necho "    event_loop_overlap (scheduler.py:812)"\n')
    py_spy.chmod(0o755)
    # Found where `pip install --target DIR` puts it: DIR/bin, DIR on sys.path (none on PATH or beside python).
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.setattr(sys, "path", [*sys.path, str(tmp_path)])
    assert engine_processes.find_py_spy() == str(py_spy)
    # Round 1's direct pass at 4 requests (calls 5-8) stalls (a request completing meanwhile passes a check).
    engine = StallingEngine({5, 6, 7, 8}, released)
    health = FaultToleranceConfig(health_interval_s=0.05, health_timeout_s=5.0, failure_threshold=2)
    report = _measure(monkeypatch, engine, engine_group, _args(out, requests="4", repeats=2), health)

    var = report["variants"][0]
    [dump] = var["stack_dumps"]
    assert (dump["requests"], dump["round"], dump["mode"], dump["incarnation"]) == (4, 1, "direct", 0)
    assert dump["after_s"] >= 0 and "unhealthy" in dump["health_error"]
    [proc] = dump["processes"]
    assert proc["pid"] == engine_group and proc["command"]
    assert "event_loop_overlap (scheduler.py:812)" in proc["stack"] and "MainThread" in proc["native_stack"]
    assert calls.read_text().splitlines() == [f"dump --pid {engine_group}", f"dump --pid {engine_group} --native"]
    # The stalled pass still completed (one failed check is not the two that replace an engine): 2 rounds, no failure.
    assert var["failures"] == [] and report["rows"][0]["rounds"] == 2
    assert json.loads(out.read_text())["variants"][0]["stack_dumps"] == var["stack_dumps"]


def test_without_py_spy_the_dump_says_so() -> None:
    [proc] = asyncio.run(engine_processes.dump_stacks([os.getpid()], None))
    assert proc["pid"] == os.getpid() and "py-spy not found" in proc["stack"]


def test_the_summary_counts_complete_rounds_only() -> None:
    runs = [bench.Run("v", "direct", 8, 80, 1.0, 1), bench.Run("v", "manager", 8, 80, 2.0, 1),
            bench.Run("v", "direct", 8, 80, 0.1, 2),  # its manager pass failed
            bench.Run("v", "direct", 8, 80, 0.5, 3), bench.Run("v", "manager", 8, 80, 0.5, 3)]
    failure = bench.Failure("v", 8, 2, "manager", "EngineError: x", 0.5)
    [row] = bench.summarize([{"variant": "v", "runs": runs, "failures": [failure], "given_up": []}], [8])
    assert (row["rounds"], row["failures"]) == (2, 1)
    assert row["direct_min_max"] == [80.0, 160.0] and row["direct_tok_s"] == 120.0
    assert row["manager_tok_s"] == 100.0 and row["manager_over_best_raw"] == pytest.approx(100 / 120)
