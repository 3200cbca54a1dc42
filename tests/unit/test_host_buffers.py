"""Checkpoint host buffers: a reservation made from predicted sizes holds the first snapshot."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from miles_lite.checkpoint import AsyncCheckpointer, CheckpointPayload, CheckpointReader, GlobalPiece, newest_complete
from miles_lite.checkpoint.host_buffers import HostBuffers, pack_first_fit


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(300, 7, generator=gen), "b": torch.randn(1000, generator=gen).to(torch.bfloat16),
            "c": torch.randint(0, 100, (33,), generator=gen), "d": torch.randn(5, 5, generator=gen)[:, 1:]}


def _sizes(ts: dict[str, torch.Tensor]) -> list[int]:
    return [t.numel() * t.element_size() for t in ts.values()]


def test_first_fit_packing_is_deterministic_and_bounded() -> None:
    sizes = [700, 300, 300, 1000, 20, 650]
    bins = pack_first_fit(sizes, 1024)
    assert sorted(i for b in bins for i in b) == list(range(len(sizes)))
    assert all(sum((sizes[i] + 255) // 256 * 256 for i in b) <= 1024 for b in bins)
    assert bins == pack_first_fit(list(sizes), 1024)
    assert pack_first_fit([5000], 1024) == [[0]]  # a tensor larger than a chunk gets a chunk of its own


def test_reserved_arena_holds_the_first_snapshot_without_allocating() -> None:
    src = _tensors(0)
    buffers = HostBuffers(pinned=False, chunk_bytes=4096)
    buffers.reserve(_sizes(src))
    staged = buffers.stage_all(list(src.items()))
    assert buffers.allocations == 0 and buffers.reserved_bytes >= buffers.nbytes > 0
    for key, t in src.items():
        assert torch.equal(staged[key], t) and staged[key].dtype == t.dtype and staged[key].is_contiguous()
    ptrs = {k: v.data_ptr() for k, v in staged.items()}
    assert len(set(ptrs.values())) == len(ptrs)
    again = buffers.stage_all(list(_tensors(1).items()))  # same shapes: the same buffers, new contents
    assert {k: v.data_ptr() for k, v in again.items()} == ptrs and buffers.allocations == 0
    assert torch.equal(again["a"], _tensors(1)["a"])


def test_too_small_a_reservation_falls_back_to_allocating() -> None:
    src = _tensors(0)
    buffers = HostBuffers(pinned=False)
    buffers.reserve(_sizes(src)[:2])
    staged = buffers.stage_all(list(src.items()))
    assert buffers.allocations == 2
    assert all(torch.equal(staged[k], t) for k, t in src.items())
    with pytest.raises(RuntimeError, match="already reserved"):
        buffers.reserve([1])


def test_checkpoint_from_reserved_buffers_reads_back(tmp_path: Path) -> None:
    saver = AsyncCheckpointer(tmp_path, buffers=HostBuffers(pinned=False, chunk_bytes=2048))
    src = _tensors(3)
    saver.reserve(_sizes(src))
    saver.save(1, CheckpointPayload(pieces=[GlobalPiece.whole(k, t) for k, t in src.items()], shared={"s": 1}))
    for t in src.values():  # training mutates the state while the flush runs
        t.zero_()
    saver.finalize()
    assert saver.describe()["host_allocations_in_save"] == 0
    saver.close()
    reader = CheckpointReader(newest_complete(tmp_path))  # type: ignore[arg-type]
    for key, t in _tensors(3).items():
        assert torch.equal(reader.global_tensor(key), t), key
