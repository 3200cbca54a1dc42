"""Training time blocked by an async checkpoint vs the time of a synchronous save of the same state.

    .venv/bin/python benchmarks/checkpoint.py [--mib 320] [--tensors 80] [--dir DIR] [--dcp]

Saves the same state (`--tensors` fp32 tensors, `--mib` MiB in all) three times asynchronously
(the first save allocates the persistent host buffers; later ones reuse them) and once
synchronously, and prints blocked / flush seconds side by side. `--dcp` adds
`torch.distributed.checkpoint.async_save` (thread mode) on the same state for reference.
Exit status 1 when the steady-state async blocked time exceeds 10% of the synchronous save.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from miles_lite.checkpoint import AsyncCheckpointer, CheckpointPayload, GlobalPiece


def make_state(mib: int, tensors: int) -> list[torch.Tensor]:
    """`tensors` random fp32 tensors totalling about `mib` MiB."""
    per = max(1, (mib << 20) // 4 // tensors)
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(per, generator=gen) for _ in range(tensors)]


def payload(state: list[torch.Tensor]) -> CheckpointPayload:
    return CheckpointPayload(pieces=[GlobalPiece.whole(f"t{i}", t) for i, t in enumerate(state)],
                             shared={"note": "benchmark"})


def dcp_blocked(state: list[torch.Tensor], root: Path) -> tuple[float, float]:
    """(blocked, total) seconds of one DCP thread-mode async_save (single process, gloo)."""
    import os

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29587")
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=0, world_size=1)
    sd = {f"t{i}": t for i, t in enumerate(state)}
    t0 = time.perf_counter()
    fut = dcp.async_save(sd, checkpoint_id=str(root / "dcp"))
    blocked = time.perf_counter() - t0
    fut.result()
    total = time.perf_counter() - t0
    dist.destroy_process_group()
    return blocked, total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=320)
    parser.add_argument("--tensors", type=int, default=80)
    parser.add_argument("--dir", default=None, help="checkpoint directory (default: a temporary one, removed)")
    parser.add_argument("--dcp", action="store_true", help="also time torch DCP async_save")
    args = parser.parse_args(argv)
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="ckpt-bench-"))
    state = make_state(args.mib, args.tensors)
    nbytes = sum(t.numel() * 4 for t in state)
    rows: list[tuple[str, float, float]] = []
    try:
        saver = AsyncCheckpointer(root / "async", keep_last=1)
        for step in (1, 2, 3):
            stats = saver.save(step, payload(state))
            for t in state:  # the "training step" that runs during the flush
                t.mul_(1.0)
            done = saver.finalize()
            assert done is not None and done.flush_s is not None
            label = "async save (first: allocates host buffers)" if step == 1 else f"async save #{step}"
            rows.append((label, stats.blocked_s, done.flush_s + (done.commit_s or 0.0)))
        saver.close()
        sync = AsyncCheckpointer(root / "sync", keep_last=1, async_save=False)
        t0 = time.perf_counter()
        sync.save(1, payload(state))
        sync_s = time.perf_counter() - t0
        sync.close()
        rows.append(("synchronous save", sync_s, sync_s))
        if args.dcp:
            blocked, total = dcp_blocked(state, root)
            rows.append(("torch DCP async_save (thread)", blocked, total))
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    steady = min(b for label, b, _ in rows if label.startswith("async save #"))
    print(f"state: {len(state)} fp32 tensors, {nbytes / 2**20:.0f} MiB; torch threads {torch.get_num_threads()}")
    print(f"{'save':<45} {'blocked s':>10} {'flush+commit s':>15}")
    for label, blocked, total in rows:
        print(f"{label:<45} {blocked:>10.3f} {total:>15.3f}")
    ratio = steady / sync_s
    verdict = "OK" if ratio <= 0.10 else "FAIL"
    print(f"steady async blocked / sync save = {steady:.3f} / {sync_s:.3f} = {ratio * 100:.1f}% (<= 10%: {verdict})")
    return 0 if ratio <= 0.10 else 1


if __name__ == "__main__":
    sys.exit(main())
