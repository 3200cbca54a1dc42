"""`benchmarks/grpo_steps.py`: the overrides each shape runs with, and the result file kept current per step."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from grpo_steps import StepReport, overrides, parse_args  # noqa: E402


def _overrides(*argv: str) -> list[str]:
    args, extra = parse_args(list(argv))
    return overrides(args, Path("/m"), Path("/o")) + extra


def test_the_7b_shape_sets_every_memory_knob() -> None:
    over = _overrides("--shape", "qwen2.5-7b")
    for expected in ("rollout.prompts_per_step=16", "rollout.group_size=8", "rollout.max_new_tokens=256",
                     "rollout.sglang_args.mem_fraction_static=0.2", "trainer.micro_batch_tokens=4096",
                     "trainer.offload.params=true", "trainer.offload.grads=true", "trainer.offload.optimizer=false",
                     "trainer.use_distributed_optimizer=false", "trainer.max_update_ratio=0",
                     "trainer.offload.when=always", "+trainer.transformer.recompute_granularity=full",
                     "cluster.colocated_memory=handoff",
                     "cluster.placement=colocated", "checkpoint.dir=''"):
        assert expected in over, expected
    # Each flag overrides its default; resident keeps the knobs.
    over = _overrides("--shape", "qwen2.5-7b", "--offload", "none", "--no-recompute", "--mem-fraction", "0.25",
                      "--memory", "resident", "--checkpoint-interval", "5")
    assert "trainer.offload.params=false" in over and "trainer.offload.optimizer=false" in over
    assert not any("recompute_granularity" in o for o in over)
    assert "rollout.sglang_args.mem_fraction_static=0.25" in over and "cluster.colocated_memory=resident" in over
    assert "checkpoint.interval=5" in over and "checkpoint.dir=''" not in over


def test_the_default_shape_keeps_the_recipe_batch() -> None:
    over = _overrides()
    assert "rollout.prompts_per_step=64" in over and "trainer.offload.optimizer=true" in over
    assert not any(o.startswith("trainer.micro_batch_tokens") or o.startswith("trainer.max_update_ratio") for o in over)
    with pytest.raises(SystemExit):
        parse_args(["--offload", "params,moments"])


def _record(step: int) -> str:
    return json.dumps({"step": step, "time/train_seconds": float(step), "time/offload_seconds": 0.5,
                       "time/engine_wake_seconds": 0.25, "memory/train_trainer_peak_bytes": 2.0 * (1 << 30)})


def test_the_result_file_follows_the_run_step_by_step(tmp_path: Path) -> None:
    run = tmp_path / "runs" / "r1"
    run.mkdir(parents=True)
    out = tmp_path / "result.json"
    report = StepReport(tmp_path / "runs", out, skip=0, meta={"shape": "s"})
    report.write()
    assert json.loads(out.read_text())["status"] == "running"
    metrics = run / "metrics.jsonl"
    metrics.write_text(_record(1) + "\n" + '{"step": 2, "time/tr')  # the second line is still being written
    report.update()
    result = json.loads(out.read_text())
    assert [r["step"] for r in result["steps"]] == [1]
    assert result["steps"][0]["offload_s"] == 0.5 and result["steps"][0]["train_peak_gib"] == 2.0
    assert result["steps"][0]["onload_s"] is None
    metrics.write_text(_record(1) + "\n" + _record(2) + "\n")
    report.finish("failed: stopped")
    result = json.loads(out.read_text())
    assert result["status"] == "failed: stopped" and [r["step"] for r in result["steps"]] == [1, 2]
    assert result["spread"]["train"] == {"min": 1.0, "median": 1.5, "max": 2.0, "n": 2}
    assert result["spread"]["engine_wake_s"]["n"] == 2 and "onload_s" not in result["spread"]


def test_profiled_steps_are_named_on_the_command_line_and_left_out_of_the_figures(tmp_path: Path) -> None:
    args, _ = parse_args(["--profile-push", "3,4"])
    assert args.profile_push == {3, 4}
    for bad in ("0", "x", ""):
        with pytest.raises(SystemExit):
            parse_args(["--profile-push", bad])
    run = tmp_path / "runs" / "r1"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(_record(s) + "\n" for s in (1, 2, 3, 4)))
    report = StepReport(tmp_path / "runs", tmp_path / "result.json", skip=1, meta={}, profiled={3, 4})
    report.finish("done")
    result = json.loads((tmp_path / "result.json").read_text())
    assert [r["step"] for r in result["steps"]] == [1, 2, 3, 4]
    assert result["spread"]["train"]["n"] == 1 and result["first_step_logged_s"] >= 0.0


def test_a_push_profile_names_the_phases_and_the_probe(tmp_path: Path) -> None:
    """The profiler's wrappers over the hand-off, the coordinator and the phase timer, on a fake hand-off."""
    from push_profile import PushProfiler

    from miles_lite import timing
    from miles_lite.run.handoff import Handoff
    from miles_lite.weight_sync.coordinator import WeightSyncCoordinator

    saved = (Handoff.prepare_push, Handoff.push, WeightSyncCoordinator.score_trainer_probe, timing.PhaseTimer.phase)
    try:
        def prepare(self: object, version: int, saving: bool = False) -> None:
            WeightSyncCoordinator.score_trainer_probe(object(), str(version))

        def push(self: object, version: int) -> str:
            with timing.PhaseTimer().phase("load"):
                return "pushed"

        Handoff.prepare_push, Handoff.push = prepare, push  # type: ignore[method-assign]
        WeightSyncCoordinator.score_trainer_probe = lambda self, version: 0.0  # type: ignore[method-assign]
        PushProfiler({2}, tmp_path / "prof").install()
        for version in (1, 2):
            Handoff.prepare_push(object(), version, saving=True)  # type: ignore[arg-type]
            assert Handoff.push(object(), version) == "pushed"  # type: ignore[arg-type]
        assert sorted(p.name for p in (tmp_path / "prof").iterdir()) == ["step-2.json.gz", "step-2.txt"]
        text = (tmp_path / "prof" / "step-2.txt").read_text()
        assert all(label in text for label in ("prepare_push", "probe_trainer", "push", "phase load"))
    finally:
        (Handoff.prepare_push, Handoff.push, WeightSyncCoordinator.score_trainer_probe,
         timing.PhaseTimer.phase) = saved  # type: ignore[method-assign]


def test_the_push_phases_reach_the_row_the_spread_and_the_sitting_summary(tmp_path: Path) -> None:
    from grpo_steps import spread, step_row

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    from gpu_summary import push_table

    records = [{"step": s, "time/sync_seconds": 0.4, "sync/phase_wake_weights_seconds": 0.02,
                "sync/phase_load_seconds": 0.1 * s, "sync/phase_verify_seconds": 0.05,
                "memory/sync_device_used_bytes": 2.0**30} for s in (1, 2, 3)]
    rows = [step_row(m) for m in records]
    assert rows[1]["sync_phases"] == {"wake_weights": 0.02, "load": 0.2, "verify": 0.05}
    sp = spread(rows)
    assert sp["sync_used_gib"]["median"] == 1.0
    assert [k for k in sp if k.startswith("push_")] == ["push_wake_weights", "push_load", "push_verify"]
    assert sp["push_load"]["median"] == pytest.approx(0.2) and sp["push_load"]["max"] == pytest.approx(0.3)
    (tmp_path / "colocated-0.5b.json").write_text(json.dumps({"status": "done", "steps": rows, "spread": sp}))
    table = push_table(tmp_path)
    # In push order, the memory figures of the sync phase (`sync_used_gib`) not taken for push phases.
    assert [line.split(" | ")[1] for line in table[2:]] == ["wake_weights", "load", "verify"]
    assert "| colocated-0.5b | load | 0.200 (0.100-0.300) |" in table


def test_the_sitting_summary_says_what_the_trainer_kept_while_the_engines_generated(tmp_path: Path) -> None:
    from grpo_steps import spread, step_row

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    from gpu_summary import grpo_table

    records = [{"step": s, "time/sync_seconds": 0.2, "time/offload_seconds": 0.01,
                "memory/generate_trainer_state_bytes": 6.5 * 2**30} for s in (1, 2, 3)]
    rows = [{**step_row(m), "step_s": 5.0} for m in records]
    (tmp_path / "colocated-0.5b-kept.json").write_text(json.dumps({"status": "done", "steps": rows,
                                                                    "spread": spread(rows)}))
    header, _, row = grpo_table(tmp_path)
    assert header.endswith("| trainer state while generating, GiB |")
    assert row.startswith("| colocated-0.5b-kept (done) | 3 |") and row.endswith("| 6.50 (6.50-6.50) |")


def test_guard_table_merges_one_file_per_precision(tmp_path, monkeypatch):
    """The guard part runs each precision in a process of its own; the summary shows every precision's row."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "scripts"))
    from gpu_summary import guard_table

    def result(cfg: str, cost: float) -> dict:
        return {"device": "gpu", f"guard/{cfg}": {"on_cost": cost, "on_cost_per_round": [cost - 0.01, cost + 0.02]}}

    (tmp_path / "guard-7b-bf16.json").write_text(json.dumps(result("bf16", 0.013)))
    (tmp_path / "guard-7b-fp8-delayed.json").write_text(json.dumps(result("fp8-delayed", 0.003)))
    table = guard_table(tmp_path)
    assert table[2:] == ["| bf16 | +1.3% | +0.3% to +3.3% | - |", "| fp8-delayed | +0.3% | -0.7% to +2.3% | - |"]
