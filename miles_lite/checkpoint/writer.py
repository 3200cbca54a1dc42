"""The flush of one save: every rank writes its files, rank 0 checks coverage and commits.

Runs on the checkpointer's background thread (or inline for synchronous saves). Ranks talk only
over the checkpointer's own gloo group, never the trainer's, so a flush can overlap training
collectives without interleaving with them.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import Tensor

from miles_lite.checkpoint.layout import (
    ASSETS_DIR,
    SHARED_OBJECTS,
    FileEntry,
    GlobalTensorEntry,
    Manifest,
    PieceEntry,
    apply_retention,
    commit,
    rank_object_file,
    rank_tensor_file,
    step_dir_name,
    write_file_durable,
)
from miles_lite.checkpoint.tensor_io import write_safetensors


class CheckpointSaveError(RuntimeError):
    """A save failed on some rank; nothing was committed and the previous checkpoint is intact."""


@dataclass
class PieceRecord:
    """Index entry of one snapshotted global-tensor piece (the tensor itself is in `Snapshot.tensors`)."""

    name: str
    key: str
    global_shape: tuple[int, ...]
    dtype: str
    dim: int
    start: int
    stop: int


@dataclass
class Snapshot:
    """Host copies and serialised trees of one rank's payload, ready to be written.

    Attributes:
        tensors: key -> contiguous host tensor (the rank's tensor file, in this order).
        pieces: index of the global-tensor pieces among `tensors`.
        local_pickle: pickled private tree (tensors replaced by references).
        shared_pickle: rank 0's pickled shared tree (None elsewhere).
        assets: rank 0's files for `hf/`.
        meta: rank 0's manifest metadata.
        ready: waited on before reading `tensors` (CUDA events after non-blocking copies).
        reused: bytes of `tensors` that are host copies made before the snapshot (not copied by it).
    """

    tensors: dict[str, Tensor]
    pieces: list[PieceRecord]
    local_pickle: bytes
    shared_pickle: bytes | None
    assets: dict[str, bytes | Path]
    meta: dict[str, Any]
    ready: tuple[Any, ...] = ()
    nbytes: int = 0
    reused: int = 0


@dataclass
class RankReport:
    """What a rank tells rank 0 after writing: its files, pieces, bytes, or the error it hit."""

    rank: int
    files: dict[str, FileEntry] = field(default_factory=dict)
    pieces: list[PieceRecord] = field(default_factory=list)
    error: str | None = None


@dataclass(frozen=True)
class FlushResult:
    path: Path
    flush_s: float
    commit_s: float
    total_bytes: int
    # An existing checkpoint of the same step was replaced (known on rank 0).
    replaced: bool = False


def write_rank_files(tmp_dir: Path, rank: int, snap: Snapshot) -> RankReport:
    """Write this rank's tensor file, object file and (rank 0) shared tree and assets; fsync each."""
    report = RankReport(rank=rank, pieces=snap.pieces)
    for event in snap.ready:
        event.synchronize()
    name = rank_tensor_file(rank)
    # A view of a host copy made before the snapshot may be strided (a slice of a fused weight): laid out here,
    # off the training thread.
    report.files[name] = write_safetensors(tmp_dir / name, {k: t.contiguous() for k, t in snap.tensors.items()})
    name = rank_object_file(rank)
    report.files[name] = write_file_durable(tmp_dir / name, snap.local_pickle)
    if snap.shared_pickle is not None:
        report.files[SHARED_OBJECTS] = write_file_durable(tmp_dir / SHARED_OBJECTS, snap.shared_pickle)
    for rel, src in snap.assets.items():
        target = tmp_dir / ASSETS_DIR / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        data = src if isinstance(src, bytes) else Path(src).read_bytes()
        report.files[f"{ASSETS_DIR}/{rel}"] = write_file_durable(target, data)
    return report


def build_tensor_index(reports: list[RankReport]) -> dict[str, GlobalTensorEntry]:
    """Merge every rank's pieces into the manifest index; ValueError if a tensor is not fully covered."""
    index: dict[str, GlobalTensorEntry] = {}
    seen: dict[str, set[tuple[int, int, int]]] = {}
    for report in reports:
        fname = rank_tensor_file(report.rank)
        for p in report.pieces:
            entry = index.setdefault(p.name, GlobalTensorEntry(shape=list(p.global_shape), dtype=p.dtype))
            if entry.shape != list(p.global_shape) or entry.dtype != p.dtype:
                raise ValueError(f"global tensor {p.name!r}: ranks disagree on shape/dtype "
                                 f"({entry.shape}/{entry.dtype} vs {list(p.global_shape)}/{p.dtype})")
            pos = (p.dim, p.start, p.stop)
            if pos in seen.setdefault(p.name, set()):
                continue  # the same slice from another rank (replicated over data parallelism)
            seen[p.name].add(pos)
            entry.pieces.append(PieceEntry(file=fname, key=p.key, dim=p.dim, start=p.start, stop=p.stop))
    for name, entry in index.items():
        dims = {p.dim for p in entry.pieces}
        if len(dims) != 1:
            raise ValueError(f"global tensor {name!r} is sliced along several dims {sorted(dims)}; use one")
        extent = entry.shape[dims.pop()] if entry.shape else 1
        covered = 0
        for p in sorted(entry.pieces, key=lambda q: q.start):
            if p.start > covered:
                break
            covered = max(covered, p.stop)
        if covered < extent:
            raise ValueError(f"global tensor {name!r}: pieces cover rows [0, {covered}) of {extent}; "
                             "some rank did not contribute its slice")
    return index


class Flusher:
    """Writes one snapshot and (on rank 0) commits it; one instance per checkpointer."""

    def __init__(self, root: Path, rank: int, world_size: int, group: dist.ProcessGroup | None,
                 keep_last: int, keep_every: int) -> None:
        self.root = root
        self.rank = rank
        self.world_size = world_size
        self.group = group
        self.keep_last = keep_last
        self.keep_every = keep_every

    def _gather(self, report: RankReport) -> list[RankReport] | None:
        if self.group is None:
            return [report]
        out: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(report, out, dst=0, group=self.group)
        return out

    def _broadcast(self, status: str | None) -> str:
        if self.group is None:
            return status or ""
        box = [status]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return str(box[0])

    def flush(self, step: int, tmp_dir: Path, snap: Snapshot) -> FlushResult:
        """Write, gather, commit; raise CheckpointSaveError on every rank when any rank failed."""
        t0 = time.perf_counter()
        try:
            report = write_rank_files(tmp_dir, self.rank, snap)
        except Exception as exc:  # reported to rank 0 so that every rank fails the same way
            report = RankReport(rank=self.rank, error=f"rank {self.rank}: {type(exc).__name__}: {exc}")
        flush_s = time.perf_counter() - t0
        reports = self._gather(report)
        status, total, replaced = None, 0, False
        t1 = time.perf_counter()
        if self.rank == 0:
            assert reports is not None
            errors = [r.error for r in reports if r.error]
            status = "; ".join(errors) if errors else None
            if status is None:
                try:
                    total, replaced = self._commit(step, tmp_dir, snap.meta, reports)
                except Exception as exc:
                    status = f"commit of step {step}: {type(exc).__name__}: {exc}"
            if status is not None:
                shutil.rmtree(tmp_dir, ignore_errors=True)
            status = status or "ok"
        status = self._broadcast(status)
        if status != "ok":
            raise CheckpointSaveError(f"checkpoint of step {step} failed: {status}")
        return FlushResult(path=self.root / step_dir_name(step), flush_s=flush_s,
                           commit_s=time.perf_counter() - t1, total_bytes=total, replaced=replaced)

    def _commit(self, step: int, tmp_dir: Path, meta: Mapping[str, Any],
                reports: list[RankReport]) -> tuple[int, bool]:
        files: dict[str, FileEntry] = {}
        for r in reports:
            files.update(r.files)
        manifest = Manifest(step=step, world_size=self.world_size, files=files,
                            global_tensors=build_tensor_index(reports), meta=dict(meta),
                            created_unix=time.time())
        _, replaced = commit(tmp_dir, manifest)
        apply_retention(self.root, self.keep_last, self.keep_every)
        return sum(e.bytes for e in files.values()), replaced
