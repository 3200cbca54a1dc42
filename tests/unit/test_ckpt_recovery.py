"""Checkpoints that survive re-runs and damage: a step saved twice replaces the first, a damaged newest
checkpoint is passed over by auto-resume (with the reason said), a roll-back sets the newer ones aside."""

from __future__ import annotations

from pathlib import Path

import torch

from miles_lite.checkpoint import AsyncCheckpointer, CheckpointPayload, CheckpointReader, GlobalPiece, resolve_resume
from miles_lite.checkpoint.layout import list_step_dirs, read_latest, step_dir_name
from miles_lite.checkpoint.resume import set_aside_newer
from miles_lite.config.schema import CheckpointConfig


def _payload(value: float) -> CheckpointPayload:
    return CheckpointPayload(pieces=[GlobalPiece.whole("w", torch.full((64, 4), value))], shared={"v": value})


def _save(root: Path, steps: list[int], value: float = 0.0) -> None:
    saver = AsyncCheckpointer(root, keep_last=0)
    for step in steps:
        saver.save(step, _payload(value + step))
    saver.finalize()
    saver.close()


def test_saving_an_existing_step_replaces_it(tmp_path: Path) -> None:
    _save(tmp_path, [1, 2])
    saver = AsyncCheckpointer(tmp_path, keep_last=0)
    first = saver.save(2, _payload(42.0))
    assert not first.complete
    done = saver.finalize()  # the same step again: no "already exists" failure
    saver.close()
    assert done is not None and done.replaced
    reader = CheckpointReader(tmp_path / step_dir_name(2))
    assert torch.equal(reader.global_tensor("w"), torch.full((64, 4), 42.0))
    assert read_latest(tmp_path) == step_dir_name(2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", step_dir_name(1), step_dir_name(2)]


def test_auto_resume_falls_back_past_a_corrupted_newest_checkpoint(tmp_path: Path) -> None:
    _save(tmp_path, [1, 2, 3])
    # Same size, different bytes: only a full checksum sees it (file sizes alone pass).
    target = tmp_path / step_dir_name(3) / "rank_00000.safetensors"
    data = bytearray(target.read_bytes())
    data[-5] ^= 0xFF
    target.write_bytes(bytes(data))
    said: list[str] = []
    found = resolve_resume(CheckpointConfig(dir=str(tmp_path), resume="auto"), said.append)
    assert found == tmp_path / step_dir_name(2)
    assert len(said) == 1 and step_dir_name(3) in said[0] and "sha256" in said[0] and "trying the one before" in said[0]
    # A root given as checkpoint.resume falls back the same way.
    assert resolve_resume(CheckpointConfig(resume=str(tmp_path)), said.append) == tmp_path / step_dir_name(2)


def test_roll_back_sets_the_newer_checkpoints_aside(tmp_path: Path) -> None:
    _save(tmp_path, [1, 2, 3])
    said: list[str] = []
    moved = set_aside_newer(tmp_path, 1, said.append)
    assert [p.name for p in moved] == [step_dir_name(2), step_dir_name(3)]
    assert all(p.parent.parent == tmp_path / "superseded" and (p / "manifest.json").is_file() for p in moved)
    assert [s for s, _ in list_step_dirs(tmp_path)] == [1]
    assert step_dir_name(2) in said[0] and str(moved[0].parent) in said[0]
    # The continuation's own step 2 and 3 are then ordinary new saves, and auto-resume takes them.
    _save(tmp_path, [2, 3], value=100.0)
    newest = resolve_resume(CheckpointConfig(dir=str(tmp_path)), said.append)
    assert newest == tmp_path / step_dir_name(3)
    assert CheckpointReader(newest).shared()["v"] == 103.0
    assert set_aside_newer(tmp_path, 3, said.append) == []
