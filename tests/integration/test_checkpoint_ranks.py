"""Two gloo ranks save synthetic TP shards asynchronously while running collectives; one process reads them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from trainer_harness import run_ranks

from miles_lite.checkpoint import AsyncCheckpointer, CheckpointPayload, CheckpointReader, GlobalPiece, newest_complete
from miles_lite.checkpoint.layout import read_latest, step_dir_name


def _full(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return torch.randn(6, 4, generator=gen), torch.randn(4, 10, generator=gen)


def scenario_sharded_save(rank: int, world_size: int, root: str) -> dict[str, Any]:
    saver = AsyncCheckpointer(root, keep_last=1)
    flags = []
    for step in (1, 2):
        col, row = _full(step)
        pieces = [GlobalPiece("col", col.chunk(world_size, 0)[rank].clone(), (6, 4), 0, 3 * rank),
                  GlobalPiece("row", row.chunk(world_size, 1)[rank].clone(), (4, 10), 1, 5 * rank),
                  GlobalPiece.whole("norm", torch.full((4,), float(step)))]  # replicated: both ranks give it
        payload = CheckpointPayload(pieces=pieces, local={"rank": rank, "rng": torch.full((2,), float(rank + step))},
                                    shared={"step": step} if rank == 0 else None,
                                    meta={"tp": world_size} if rank == 0 else None)
        saver.save(step, payload)
        flags.append(saver.in_flight)
        # Training collectives on the default group while this rank's flush runs on its own group.
        total = torch.ones(1)
        for _ in range(20):
            dist.all_reduce(total)
        flags.append(float(total))
    stats = saver.finalize()
    saver.close()
    assert stats is not None
    return {"flags": flags, "total_bytes": stats.total_bytes, "bytes": stats.bytes}


def test_two_ranks_save_and_one_rank_reads(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    results = run_ranks(scenario_sharded_save, 2, tmp_path / "out", root=str(root))
    assert results[0]["flags"][1] == 2.0 ** 20 and results[1]["flags"][3] == 2.0 ** 20
    assert results[0]["total_bytes"] > results[0]["bytes"] > 0 and results[1]["total_bytes"] == 0
    assert read_latest(root) == step_dir_name(2) and not (root / step_dir_name(1)).exists()
    reader = CheckpointReader(newest_complete(root))  # type: ignore[arg-type]
    col, row = _full(2)
    assert reader.manifest.world_size == 2 and reader.meta == {"tp": 2}
    assert torch.equal(reader.global_tensor("col"), col) and torch.equal(reader.global_tensor("row"), row)
    # Resharded reads: a TP=1 rank takes everything, a TP=4 rank its quarter.
    assert torch.equal(reader.global_slice("row", 1, 5, 10), row[:, 5:])
    assert torch.equal(reader.global_slice("col", 0, 3, 5), col[3:5])
    assert torch.equal(reader.global_tensor("norm"), torch.full((4,), 2.0))
    assert len(reader.manifest.global_tensors["norm"].pieces) == 1  # de-duplicated
    assert reader.shared() == {"step": 2}
    for r in range(2):
        local = reader.local(r)
        assert local is not None and local["rank"] == r and torch.equal(local["rng"], torch.full((2,), r + 2.0))
