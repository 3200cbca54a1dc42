"""Checkpoint layout, commit, retention, checksums, snapshot isolation and driver state (one process)."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from miles_lite.checkpoint import (
    AsyncCheckpointer,
    CheckpointPayload,
    CheckpointReader,
    CheckpointSaveError,
    ChecksumMismatchError,
    DriverState,
    GlobalPiece,
    SaverState,
    newest_complete,
    resolve_resume,
)
from miles_lite.checkpoint.driver_state import capture_driver_rng, restore_driver_rng
from miles_lite.checkpoint.layout import read_latest, retention_victims, step_dir_name
from miles_lite.config.schema import CheckpointConfig
from miles_lite.data.gsm8k import MathProblem
from miles_lite.data.source import PromptSource


def _payload(w: torch.Tensor, step: int, **kw: object) -> CheckpointPayload:
    half = w.shape[0] // 2
    pieces = [GlobalPiece("w", w[:half], tuple(w.shape), 0, 0), GlobalPiece("w", w[half:], tuple(w.shape), 0, half)]
    return CheckpointPayload(pieces=pieces, local={"r": torch.arange(4) + step, "obj": {"k": [step, (1, 2)]}},
                             shared={"step": step, "t": torch.full((3,), float(step))},
                             assets={"config.json": b'{"a": 1}'}, meta={"step_meta": step}, **kw)  # type: ignore[arg-type]


def _save_steps(root: Path, steps: list[int], **kw: object) -> tuple[AsyncCheckpointer, torch.Tensor]:
    """Save `steps` of a weight bumped after each save; returns the saver and the last saved value."""
    saver = AsyncCheckpointer(root, **kw)  # type: ignore[arg-type]
    w = torch.randn(8, 3)
    saved = w.clone()
    for s in steps:
        saver.save(s, _payload(w, s))
        saved = w.clone()
        w.add_(1.0)
    saver.finalize()
    return saver, saved


def test_retention_victims_keeps_last_every_and_protected() -> None:
    assert retention_victims([1, 2, 3, 4, 5], keep_last=2, keep_every=0, protected=[]) == [1, 2, 3]
    assert retention_victims([1, 2, 3, 4, 5, 6], keep_last=1, keep_every=2, protected=[]) == [1, 3, 5]
    assert retention_victims([1, 2, 3], keep_last=1, keep_every=0, protected=[1]) == [2]
    assert retention_victims([1, 2, 3], keep_last=0, keep_every=0, protected=[]) == []
    with pytest.raises(ValueError, match="keep_last"):
        retention_victims([1], keep_last=-1, keep_every=0, protected=[])


def test_save_commit_latest_retention_and_read_back(tmp_path: Path) -> None:
    saver, saved = _save_steps(tmp_path, [1, 2, 3, 4, 6], keep_last=2, keep_every=3)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["latest", step_dir_name(3), step_dir_name(4), step_dir_name(6)]
    assert read_latest(tmp_path) == step_dir_name(6)
    stats = saver.last
    assert stats is not None and stats.complete and stats.step == 6 and stats.path == tmp_path / step_dir_name(6)
    assert stats.total_bytes and stats.total_bytes > stats.bytes > 0 and stats.blocked_s >= stats.snapshot_s
    reader = CheckpointReader(newest_complete(tmp_path))  # type: ignore[arg-type]
    assert reader.step == 6 and reader.meta == {"step_meta": 6}
    torch.testing.assert_close(reader.global_tensor("w"), saved, rtol=0, atol=0)
    torch.testing.assert_close(reader.global_slice("w", 0, 3, 6), saved[3:6], rtol=0, atol=0)
    shared = reader.shared()
    assert shared["step"] == 6 and torch.equal(shared["t"], torch.full((3,), 6.0))
    local = reader.local(0)
    assert local is not None and torch.equal(local["r"], torch.arange(4) + 6) and local["obj"] == {"k": [6, (1, 2)]}
    assert reader.local(1) is None
    assert list(reader.assets()) == ["config.json"] and (reader.asset_dir() / "config.json").read_bytes() == b'{"a": 1}'
    saver.close()
    assert saver.state is SaverState.CLOSED


def test_snapshot_is_isolated_from_later_mutation(tmp_path: Path) -> None:
    saver = AsyncCheckpointer(tmp_path)
    w = torch.zeros(256, 256)
    saver.save(1, CheckpointPayload(pieces=[GlobalPiece.whole("w", w)]))
    w.fill_(7.0)  # training goes on while the flush runs
    saver.finalize()
    assert float(CheckpointReader(tmp_path / step_dir_name(1)).global_tensor("w").abs().max()) == 0.0


def test_corrupted_and_truncated_files_are_named(tmp_path: Path) -> None:
    _save_steps(tmp_path, [1])
    ckpt = tmp_path / step_dir_name(1)
    target = ckpt / "rank_00000.safetensors"
    data = bytearray(target.read_bytes())
    data[-1] ^= 0xFF
    target.write_bytes(bytes(data))
    with pytest.raises(ChecksumMismatchError, match=r"rank_00000\.safetensors has sha256 [0-9a-f]{64}, expected"):
        CheckpointReader(ckpt)
    target.write_bytes(bytes(data[:-10]))
    with pytest.raises(ChecksumMismatchError, match=r"rank_00000\.safetensors is \d+ bytes, expected \d+"):
        CheckpointReader(ckpt)
    # A truncated checkpoint is not "complete": auto-resume skips it.
    assert newest_complete(tmp_path) is None


def test_resume_selection_skips_incomplete_and_tmp(tmp_path: Path) -> None:
    _save_steps(tmp_path, [1, 2], keep_last=0)
    (tmp_path / step_dir_name(2) / "manifest.json").unlink()  # an interrupted delete / foreign dir
    (tmp_path / "tmp-step_00000009-abc").mkdir()
    cfg = CheckpointConfig(dir=str(tmp_path), resume="auto")
    assert resolve_resume(cfg) == tmp_path / step_dir_name(1)
    assert resolve_resume(CheckpointConfig(dir=str(tmp_path), resume="none")) is None
    explicit = CheckpointConfig(dir=None, resume=str(tmp_path / step_dir_name(1)))
    assert resolve_resume(explicit) == tmp_path / step_dir_name(1)
    with pytest.raises(FileNotFoundError, match="checkpoint.resume="):
        resolve_resume(CheckpointConfig(resume=str(tmp_path / "nowhere")))
    # A new checkpointer on this root removes the stale temporary directory.
    saver = AsyncCheckpointer(tmp_path)
    assert [p.name for p in saver.cleaned] == ["tmp-step_00000009-abc"]
    assert not (tmp_path / "tmp-step_00000009-abc").exists()


def test_failed_flush_raises_and_keeps_previous(tmp_path: Path) -> None:
    saver, _ = _save_steps(tmp_path, [1])
    bad = CheckpointPayload(pieces=[GlobalPiece.whole("w", torch.ones(2))], shared={},
                            assets={"tok.json": tmp_path / "missing.json"})
    saver.save(2, bad)
    with pytest.raises(CheckpointSaveError, match="missing.json"):
        saver.finalize()
    assert saver.state is SaverState.IDLE
    assert newest_complete(tmp_path) == tmp_path / step_dir_name(1)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("tmp-")] == []
    # Pieces that leave rows uncovered are refused at commit.
    holes = CheckpointPayload(pieces=[GlobalPiece("w", torch.ones(2, 3), (4, 3), 0, 0)])
    saver.save(3, holes)
    with pytest.raises(CheckpointSaveError, match=r"cover rows \[0, 2\) of 4"):
        saver.wait()
    saver.close()


def test_global_piece_validation() -> None:
    with pytest.raises(ValueError, match="outside dim 0"):
        GlobalPiece("x", torch.ones(2, 3), (4, 4), 0, 0)
    with pytest.raises(ValueError, match=r"rows \[3, 5\)"):
        GlobalPiece("x", torch.ones(2, 3), (4, 3), 0, 3)
    with pytest.raises(ValueError, match="dim=2"):
        GlobalPiece("x", torch.ones(2, 3), (2, 3), 2, 0)


def test_reader_reslices_pieces_of_another_layout(tmp_path: Path) -> None:
    """Pieces written split along dim 1 by 4 "ranks" read back as 3 row ranges along dim 0."""
    full = torch.randn(6, 8)
    pieces = [GlobalPiece("m", full[:, 2 * r:2 * r + 2].contiguous(), (6, 8), 1, 2 * r) for r in range(4)]
    saver = AsyncCheckpointer(tmp_path, async_save=False)
    stats = saver.save(5, CheckpointPayload(pieces=pieces))
    assert stats.complete and stats.blocked_s >= stats.flush_s  # type: ignore[operator]
    reader = CheckpointReader(stats.path)
    for r in range(3):
        torch.testing.assert_close(reader.global_slice("m", 0, 2 * r, 2 * r + 2), full[2 * r:2 * r + 2])
    torch.testing.assert_close(reader.global_slice("m", 1, 3, 7), full[:, 3:7])


def test_driver_state_round_trip_restores_data_order_and_rng(tmp_path: Path) -> None:
    problems = [MathProblem(question=f"q{i}", answer=float(i), steps=(), solution="") for i in range(10)]
    source = PromptSource(problems, seed=3)
    source.next_batch(4)
    source.keep_only([1, 2, 3, 5, 7, 9])
    source.next_batch(5)  # crosses into the next epoch
    random.seed(11)
    np.random.seed(12)
    torch.manual_seed(13)
    state = DriverState(step=7, weight_version=7, data=source.state_dict(), rng=capture_driver_rng(),
                        presample_keep=[1, 2, 3, 5, 7, 9])
    expected = ([i for i, _ in source.next_batch(8)], random.random(), float(np.random.rand()), float(torch.rand(1)))
    saver = AsyncCheckpointer(tmp_path)
    saver.save(7, CheckpointPayload(shared={"driver": state.to_tree()}))
    saver.finalize()
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    back = DriverState.from_tree(CheckpointReader(tmp_path / step_dir_name(7)).shared()["driver"])
    fresh = PromptSource(problems, seed=3)
    fresh.load_state_dict(back.data)
    restore_driver_rng(back.rng)
    got = ([i for i, _ in fresh.next_batch(8)], random.random(), float(np.random.rand()), float(torch.rand(1)))
    assert got == expected
    assert (back.step, back.weight_version, back.presample_keep) == (7, 7, [1, 2, 3, 5, 7, 9])
    with pytest.raises(ValueError, match="format"):
        DriverState.from_tree({"format": 99})
    with pytest.raises(ValueError, match="DriverState.step"):
        DriverState(step=-1, weight_version=0, data={})
