"""Asynchronous sharded checkpoints: host snapshot in the training thread, flush on a background thread.

`save()` blocks training only for (a) waiting for the previous save's flush, if still running, and
(b) copying this rank's tensors into persistent host buffers (the snapshot). A background thread
then writes the rank's files, and rank 0 commits atomically once every rank has written (see
`layout.py`). One save is in flight at a time; `finalize()` waits for the last one.

Why a thread of our own rather than `torch.distributed.checkpoint.async_save` or megatron's
`dist_checkpointing`: measured on CPU, DCP's thread mode blocks about as long as this snapshot
(both are one host copy) and its process mode costs seconds to start; megatron's async path starts
a spawn-context manager process (~4 s). Neither gives per-file sha256 in a manifest, atomic
rename-commit with a `latest` pointer, or HF-named, TP-independent pieces for the fused QKV /
gate-up layouts, all of which this format needs. The writer thread holds the GIL only between
16 MiB chunks (hashing and file writes release it).

Lifecycle (`SaverState`): IDLE -> FLUSHING (a save in flight) -> IDLE, or FAILED when a flush
raised (the error is re-raised by the next `wait`/`save`/`finalize`, then the state is IDLE again);
CLOSED after `close()`.
"""

from __future__ import annotations

import pickle
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from datetime import timedelta
from enum import StrEnum
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from miles_lite.checkpoint.host_buffers import HostBuffers
from miles_lite.checkpoint.layout import clean_stale_tmp, step_dir_name, tmp_dir_name
from miles_lite.checkpoint.payload import CheckpointPayload
from miles_lite.checkpoint.tensor_io import dtype_name, split_tensors
from miles_lite.checkpoint.writer import Flusher, FlushResult, PieceRecord, Snapshot
from miles_lite.config.schema import CheckpointConfig


class SaverState(StrEnum):
    IDLE = "idle"
    FLUSHING = "flushing"
    FAILED = "failed"
    CLOSED = "closed"


@dataclass(frozen=True)
class SaveStats:
    """Timings (seconds) and sizes (bytes) of one save on this rank.

    `blocked_s` is what training waited: `wait_s` (previous flush) + `snapshot_s` (host copy and
    pickling). `flush_s` (this rank's file writes), `commit_s` (gather + rank-0 commit) and
    `total_bytes` (all ranks, known on rank 0; 0 elsewhere) are None until the save completes.
    """

    step: int
    path: Path
    blocked_s: float
    wait_s: float
    snapshot_s: float
    bytes: int
    flush_s: float | None = None
    commit_s: float | None = None
    total_bytes: int | None = None
    # The save replaced an existing checkpoint of the same step (rank 0).
    replaced: bool = False
    # Of `bytes`, those written from host copies made already (`take_snapshot`'s `host_copy`), not copied again.
    reused_bytes: int = 0

    @property
    def complete(self) -> bool:
        return self.flush_s is not None


# A host tensor holding a tensor's bytes as they are now, and the CUDA event they land after (None: landed), or
# None where there is none (`TrainerOffload.staged_copies`: the copies a colocated trainer's offload made already).
HostCopy = Callable[[Tensor], tuple[Tensor, Any] | None]


def take_snapshot(payload: CheckpointPayload, buffers: HostBuffers, rank: int,
                  host_copy: HostCopy | None = None) -> Snapshot:
    """Copy `payload`'s tensors into `buffers` and pickle its trees; after this the caller may mutate state.

    `host_copy`: tensors it has a host copy of are written from that copy (held until the flush ends, laid out
    contiguously by the flush where it is a strided view) instead of being copied again; the snapshot's `reused`
    bytes count them."""
    loose: dict[str, Tensor] = {}
    local_tree = split_tensors(dict(payload.local), "local", loose)
    shared_tree = split_tensors(dict(payload.shared), "shared", loose) if payload.shared is not None else None
    if rank != 0 and (payload.shared is not None or payload.assets or payload.meta):
        raise ValueError(f"rank {rank} passed shared/assets/meta; only rank 0 writes those (pass None)")
    items: list[tuple[str, Tensor]] = []
    records: list[PieceRecord] = []
    seen: set[str] = set()
    for piece in payload.pieces:
        key = f"piece/{piece.name}/{piece.dim}/{piece.start}"
        if key in seen:
            raise ValueError(f"rank {rank} gave piece {piece.name!r} rows {piece.start}.. twice")
        seen.add(key)
        items.append((key, piece.tensor))
        records.append(PieceRecord(name=piece.name, key=key, global_shape=tuple(piece.global_shape),
                                   dtype=dtype_name(piece.tensor.dtype), dim=piece.dim, start=piece.start,
                                   stop=piece.stop))
    items += list(loose.items())
    found = {key: copy for key, t in items if host_copy is not None and (copy := host_copy(t)) is not None}
    copied = [(key, t) for key, t in items if key not in found]
    staged = buffers.stage_all(copied, keep=found)
    ready = [event for _, event in found.values() if event is not None]
    if any(t.is_cuda for _, t in copied):
        ready.append(torch.cuda.Event())
        ready[-1].record()
    tensors = {key: found[key][0] if key in found else staged[key] for key, _ in items}  # the payload's order
    return Snapshot(
        tensors=tensors, pieces=records,
        local_pickle=pickle.dumps(local_tree, protocol=pickle.HIGHEST_PROTOCOL),
        shared_pickle=None if shared_tree is None else pickle.dumps(shared_tree, protocol=pickle.HIGHEST_PROTOCOL),
        assets=dict(payload.assets or {}), meta=dict(payload.meta or {}), ready=tuple(ready),
        nbytes=sum(t.numel() * t.element_size() for t in tensors.values()),
        reused=sum(copy.numel() * copy.element_size() for copy, _ in found.values()),
    )


class AsyncCheckpointer:
    """Sharded checkpoints of one rank under `root`, saved asynchronously (or synchronously).

    Every rank of the job constructs one (it creates a private gloo group when torch.distributed is
    initialised with more than one rank: a collective call) and calls `save` for the same steps.

    Args:
        root: checkpoint root directory (shared by all ranks).
        keep_last / keep_every: retention (see `layout.retention_victims`).
        async_save: False writes inside `save` (blocking), same files.
        timeout_s: how long a rank waits for the others during a flush.
        buffers: host buffers to snapshot into (e.g. reserved at start-up); default: new, empty ones.
    """

    def __init__(self, root: str | Path, *, keep_last: int = 2, keep_every: int = 0, async_save: bool = True,
                 timeout_s: float = 1800.0, buffers: HostBuffers | None = None) -> None:
        if keep_last < 0 or keep_every < 0:
            raise ValueError(f"checkpoint.keep_last={keep_last} / keep_every={keep_every} must be >= 0")
        self.root = Path(root)
        self.async_save = async_save
        multi = dist.is_initialized() and dist.get_world_size() > 1
        self.rank = dist.get_rank() if multi else 0
        self.world_size = dist.get_world_size() if multi else 1
        # A group of our own: the flush thread's collectives never interleave with training ones.
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s)) if multi else None
        self.group = group
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            # Nothing of this root is in flight at start-up: leftovers are from a crash.
            self.cleaned = clean_stale_tmp(self.root)
        self._flusher = Flusher(self.root, self.rank, self.world_size, group, keep_last, keep_every)
        self._buffers = buffers if buffers is not None else HostBuffers()
        self._thread: threading.Thread | None = None
        self._pending: SaveStats | None = None
        self._result: FlushResult | None = None
        self._error: BaseException | None = None
        self.last: SaveStats | None = None
        self.state = SaverState.IDLE

    @staticmethod
    def from_config(cfg: CheckpointConfig, timeout_s: float = 1800.0,
                    buffers: HostBuffers | None = None) -> AsyncCheckpointer:
        """From `checkpoint.dir / keep_last / keep_every / async_save` (ValueError when `dir` is unset)."""
        if not cfg.dir:
            raise ValueError("checkpoint.dir is unset: set checkpoint.dir=<directory> to save checkpoints")
        return AsyncCheckpointer(cfg.dir, keep_last=cfg.keep_last, keep_every=cfg.keep_every,
                                 async_save=cfg.async_save, timeout_s=timeout_s, buffers=buffers)

    # ---- saving ---------------------------------------------------------------------------------

    def _agree_tmp_dir(self, step: int) -> Path:
        name = [tmp_dir_name(step)] if self.rank == 0 else [None]
        if self.rank == 0:
            (self.root / name[0]).mkdir(parents=True)
        if self.group is not None:
            dist.broadcast_object_list(name, src=0, group=self.group)
        return self.root / str(name[0])

    def save(self, step: int, payload: CheckpointPayload, host_copy: HostCopy | None = None) -> SaveStats:
        """Snapshot `payload` and start flushing it as checkpoint `step`; return once training may go on.

        Waits first for the previous save (re-raising its failure). Collective: every rank calls it.
        Returns this save's stats; flush fields are filled by `wait()` / `finalize()`. `host_copy`: host copies
        made already, written instead of copying those tensors again (`take_snapshot`).
        """
        if self.state is SaverState.CLOSED:
            raise RuntimeError("AsyncCheckpointer is closed")
        t0 = time.perf_counter()
        self.wait()
        wait_s = time.perf_counter() - t0
        tmp_dir = self._agree_tmp_dir(step)
        snap = take_snapshot(payload, self._buffers, self.rank, host_copy)
        snapshot_s = time.perf_counter() - t0 - wait_s
        self._pending = SaveStats(step=step, path=self.root / step_dir_name(step), blocked_s=0.0, wait_s=wait_s,
                                  snapshot_s=snapshot_s, bytes=snap.nbytes, reused_bytes=snap.reused)
        self._error, self._result = None, None
        self.state = SaverState.FLUSHING
        if self.async_save:
            self._thread = threading.Thread(target=self._run_flush, args=(step, tmp_dir, snap),
                                            name=f"ckpt-flush-{step}", daemon=True)
            self._thread.start()
            stats = replace(self._pending, blocked_s=time.perf_counter() - t0)
            self._pending = stats
            return stats
        self._run_flush(step, tmp_dir, snap)
        self._pending = replace(self._pending, blocked_s=time.perf_counter() - t0)
        done = self.wait()
        assert done is not None
        return done

    def reserve(self, sizes: Iterable[int]) -> None:
        """Allocate host buffers for snapshot tensors of `sizes` bytes now, on a background thread.

        Call once the state's size is known (before the first save): the first save then copies
        into memory that already exists instead of allocating (and pinning) it inside the step.
        """
        if self.state is SaverState.CLOSED:
            raise RuntimeError("AsyncCheckpointer is closed")
        self._buffers.reserve(sizes)

    def _run_flush(self, step: int, tmp_dir: Path, snap: Snapshot) -> None:
        try:
            self._result = self._flusher.flush(step, tmp_dir, snap)
        except BaseException as exc:  # surfaced to the training thread by wait()
            self._error = exc
            self.state = SaverState.FAILED

    def wait(self) -> SaveStats | None:
        """Block until the save in flight (if any) is committed; return its completed stats.

        Re-raises the flush's exception (CheckpointSaveError when any rank failed).
        """
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self.state is SaverState.FAILED:
            error, self._error, self._pending = self._error, None, None
            self.state = SaverState.IDLE
            assert error is not None
            raise error
        if self.state is not SaverState.FLUSHING:
            return self.last
        assert self._pending is not None and self._result is not None
        res = self._result
        self.last = replace(self._pending, path=res.path, flush_s=res.flush_s, commit_s=res.commit_s,
                            total_bytes=res.total_bytes if self.rank == 0 else 0, replaced=res.replaced)
        self._pending = None
        self.state = SaverState.IDLE
        return self.last

    def finalize(self) -> SaveStats | None:
        """End of the run: wait for the last save to commit; returns its stats (None if none)."""
        return self.wait()

    def close(self) -> None:
        """Wait for the save in flight, release host buffers and the private group (idempotent)."""
        if self.state is SaverState.CLOSED:
            return
        try:
            self.wait()
        finally:
            self._buffers.clear()
            if self.group is not None and dist.is_initialized():
                dist.destroy_process_group(self.group)
            self.group = None
            self.state = SaverState.CLOSED

    @property
    def in_flight(self) -> bool:
        return self.state is SaverState.FLUSHING

    def describe(self) -> dict[str, Any]:
        """Small status dict for logs/metrics."""
        return {"state": self.state.value, "root": str(self.root), "host_buffer_bytes": self._buffers.nbytes,
                "host_reserved_bytes": self._buffers.reserved_bytes,
                "host_allocations_in_save": self._buffers.allocations}
