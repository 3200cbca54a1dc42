"""Rollout table: rows from scored groups, one parquet file per step, read back as one dataset."""

from __future__ import annotations

import math
from pathlib import Path

import pyarrow.dataset as ds
import pytest

from miles_lite.observability import RolloutRow, RolloutTableWriter, read_rollouts, rows_from_groups
from miles_lite.observability.rollout_table import SCHEMA
from miles_lite.types import Group, Sample


def group(index: int, totals: list[float], version: str = "3") -> Group:
    g = Group(prompt_index=index, prompt_text=f"Q{index}: 2+2?", question="2+2?", answer=4.0, steps=())
    for j, total in enumerate(totals):
        g.samples.append(Sample(
            prompt_index=index, prompt_ids=[1, 2, 3], response_ids=list(range(j + 1)),
            rollout_logprobs=[-0.5] * j + [-1.5], response_text=f"answer {j}", finish_reason="stop" if j else "length",
            engine_id=f"engine-{j % 2}", weight_version=version,
            rewards={"exact_check": float(total > 1), "tag_check": 0.25, "total": total}))
    return g


def test_rows_from_groups_flatten_every_sample() -> None:
    rows = rows_from_groups(5, [group(0, [0.0, 2.5]), group(1, [5.25])])
    assert [(r.prompt_index, r.sample_index, r.total) for r in rows] == [(0, 0, 0.0), (0, 1, 2.5), (1, 0, 5.25)]
    second = rows[1]
    assert second.step == 5 and second.length == 2 and second.mean_logprob == pytest.approx(-1.0)
    assert second.rewards == {"exact_check": 1.0, "tag_check": 0.25}  # "total" is its own column
    assert second.engine == "engine-1" and second.weight_version == "3" and second.prompt == "Q0: 2+2?"


def test_steps_append_and_read_back_as_one_dataset(tmp_path: Path) -> None:
    writer = RolloutTableWriter(tmp_path)
    p1 = writer.write_groups(1, [group(0, [0.0, 1.0])])
    p2 = writer.write_groups(2, [group(0, [2.0]), group(1, [3.0, 4.0, 5.0])])
    assert p1 is not None and p2 is not None and p1.name == "step_000001.parquet"
    table = read_rollouts(tmp_path)
    assert table.schema.equals(SCHEMA)
    assert table["step"].to_pylist() == [1, 1, 2, 2, 2, 2]
    assert table["total"].to_pylist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert dict(table["rewards"][2].as_py()) == {"exact_check": 1.0, "tag_check": 0.25}
    # Plain pyarrow reads the directory as one dataset too.
    assert ds.dataset(tmp_path / "rollouts", format="parquet").count_rows() == 6
    assert not list((tmp_path / "rollouts").glob("*.tmp"))


def test_rewriting_a_step_replaces_it(tmp_path: Path) -> None:
    writer = RolloutTableWriter(tmp_path)
    writer.write_groups(1, [group(0, [0.0, 1.0])])
    writer.write_groups(1, [group(0, [9.0])])
    assert read_rollouts(tmp_path)["total"].to_pylist() == [9.0]


def test_empty_and_mismatched_input(tmp_path: Path) -> None:
    writer = RolloutTableWriter(tmp_path)
    assert writer.write_step(1, []) is None
    assert read_rollouts(tmp_path).num_rows == 0
    assert read_rollouts(tmp_path / "missing", columns=["step"]).column_names == ["step"]
    row = RolloutRow(step=2, prompt_index=0, sample_index=0, prompt="p", completion="c", total=1.0,
                     finish_reason="stop", length=1, mean_logprob=-0.1, engine="e", weight_version="1")
    with pytest.raises(ValueError, match="step"):
        writer.write_step(3, [row])


def test_empty_completion_has_nan_mean_logprob() -> None:
    g = Group(prompt_index=0, prompt_text="p", question="q", answer=1.0, steps=())
    g.samples.append(Sample(prompt_index=0, prompt_ids=[1], response_ids=[], rollout_logprobs=[]))
    (row,) = rows_from_groups(1, [g])
    assert row.length == 0 and math.isnan(row.mean_logprob) and row.total == 0.0


def test_a_table_started_before_the_push_is_written_by_publish_step(tmp_path: Path) -> None:
    import threading

    from miles_lite.config.compose import load_config
    from miles_lite.run.outputs import RunIO

    cfg = load_config([f"experiment.output_dir={tmp_path}", "observability.progress=false",
                       "observability.metrics_enabled=false"])
    writers: list[str] = []
    with RunIO(cfg, tmp_path, "run") as io:
        assert io.table is not None
        write_groups = io.table.write_groups

        def recorded(step: int, groups: list[Group]) -> Path | None:
            writers.append(threading.current_thread().name)
            return write_groups(step, groups)

        io.table.write_groups = recorded  # type: ignore[method-assign]
        io.start_rollout_table(1, [group(0, [0.0, 1.0])])
        io.publish_step(1, {}, [group(0, [0.0, 1.0])], {})
        assert read_rollouts(tmp_path)["total"].to_pylist() == [0.0, 1.0]
        # Started and published: written once, on the writer's thread; a step not started is written in place.
        io.publish_step(2, {}, [group(1, [7.0])], {})
    assert writers[0].startswith("rollout-table") and writers[1] == threading.current_thread().name
    assert read_rollouts(tmp_path)["total"].to_pylist() == [0.0, 1.0, 7.0]


def test_a_failed_background_write_is_raised_by_publish_step(tmp_path: Path) -> None:
    from miles_lite.config.compose import load_config
    from miles_lite.run.outputs import RunIO

    cfg = load_config([f"experiment.output_dir={tmp_path}", "observability.progress=false",
                       "observability.metrics_enabled=false"])
    with RunIO(cfg, tmp_path, "run") as io:
        # Rows of another step than the one written: the writer refuses them, on its thread.
        table = io.table
        assert table is not None
        rows = rows_from_groups(3, [group(0, [1.0])])
        table.write_groups = lambda step, groups: table.write_step(step, rows)  # type: ignore[method-assign]
        io.start_rollout_table(2, [group(0, [1.0])])
        with pytest.raises(ValueError, match=r"carry step\(s\) \[3\] but are written as step 2"):
            io.publish_step(2, {}, [], {})
