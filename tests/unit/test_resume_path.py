"""`checkpoint.resume` naming a checkpoint that is not there says what is: the steps retention kept, or where a
roll-back moved it."""

from __future__ import annotations

from pathlib import Path

from miles_lite.config.resume_path import resume_problem
from miles_lite.config.schema import CheckpointConfig


def test_a_step_retention_removed_names_the_steps_kept(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    for step in (3, 4):
        (root / f"step_{step:08d}").mkdir(parents=True)
    problem = resume_problem(CheckpointConfig(resume=str(root / "step_00000001"), keep_last=2))
    assert problem is not None
    assert f"{root} no longer holds step 1: it keeps step_00000003, step_00000004" in problem
    assert "checkpoint.keep_last, now 2" in problem and f"checkpoint.resume={root / 'step_00000004'}" in problem


def test_a_step_a_roll_back_moved_aside_names_where_it_went(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    moved = root / "superseded" / "20261206-101010" / "step_00000005"
    moved.mkdir(parents=True)
    problem = resume_problem(CheckpointConfig(resume=str(root / "step_00000005")))
    assert problem is not None and f"set checkpoint.resume={moved}" in problem


def test_other_values(tmp_path: Path) -> None:
    assert resume_problem(CheckpointConfig(resume="auto")) is None
    assert resume_problem(CheckpointConfig(resume="none")) is None
    assert resume_problem(CheckpointConfig(resume=str(tmp_path))) is None
    problem = resume_problem(CheckpointConfig(resume=str(tmp_path / "nowhere")))
    assert problem is not None and "does not exist" in problem
