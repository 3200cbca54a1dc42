"""On-disk layout of a checkpoint root: step directories, manifest, atomic commit, `latest`, retention.

    <root>/
      latest                      text: the directory name of the newest committed checkpoint
      step_00000012/              one committed checkpoint (complete: manifest.json is present)
        manifest.json             format, step, world size, every file's sha256 and size, tensor index
        rank_00000.safetensors    tensors written by rank 0 (global-tensor pieces, rank-local tensors)
        rank_00000.pkl            rank 0's rank-local object tree (tensors replaced by references)
        shared.pkl                the object tree every rank reads (driver state, scheduler, counters)
        hf/config.json, hf/tokenizer.json ...   assets copied at save time (for HF conversion)
      tmp-step_00000014-<uuid>/   a save being written (or left behind by a crash; removed at start)

A checkpoint becomes visible only by `os.rename` of its complete temporary directory (manifest
written and every file fsynced first), and `latest` is replaced last, by writing a temporary file
and renaming it; a crash at any point leaves either the old or the new checkpoint, never a mix.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import uuid
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

FORMAT = "miles_lite.checkpoint/1"
MANIFEST = "manifest.json"
LATEST = "latest"
SHARED_OBJECTS = "shared.pkl"
ASSETS_DIR = "hf"
# Checkpoints newer than the one a run resumed from are moved here (see `resume.set_aside_newer`).
SUPERSEDED_DIR = "superseded"
_STEP_DIR = re.compile(r"^step_(\d+)$")
_TMP_PREFIX = "tmp-"
_HASH_CHUNK = 16 << 20


def step_dir_name(step: int) -> str:
    """Directory name of the checkpoint of optimizer step `step` (zero-padded so names sort by step)."""
    if step < 0:
        raise ValueError(f"checkpoint step={step} must be >= 0")
    return f"step_{step:08d}"


def tmp_dir_name(step: int) -> str:
    """A fresh temporary directory name for a save of `step` (unique per save attempt)."""
    return f"{_TMP_PREFIX}{step_dir_name(step)}-{uuid.uuid4().hex[:12]}"


def rank_tensor_file(rank: int) -> str:
    return f"rank_{rank:05d}.safetensors"


def rank_object_file(rank: int) -> str:
    return f"rank_{rank:05d}.pkl"


def parse_step(name: str) -> int | None:
    """The step of a committed checkpoint directory name, or None for anything else."""
    match = _STEP_DIR.match(name)
    return int(match.group(1)) if match else None


@dataclass(frozen=True)
class FileEntry:
    """One file of a checkpoint: size in bytes and hex sha256 of its content."""

    sha256: str
    bytes: int


@dataclass(frozen=True)
class PieceEntry:
    """Where one slice of a global tensor lives: rows `[start, stop)` along `dim`, tensor `key` of `file`."""

    file: str
    key: str
    dim: int
    start: int
    stop: int


@dataclass
class GlobalTensorEntry:
    """A tensor stored independently of the parallel layout: full shape, dtype and its pieces."""

    shape: list[int]
    dtype: str
    pieces: list[PieceEntry] = field(default_factory=list)


@dataclass
class Manifest:
    """Everything needed to validate and read a checkpoint; written last, as `manifest.json`.

    Attributes:
        step: optimizer step the checkpoint was taken after.
        world_size: number of ranks that wrote it (rank files are numbered 0..world_size-1).
        files: relative path -> FileEntry, for every file of the checkpoint except the manifest.
        global_tensors: name -> GlobalTensorEntry (layout-independent tensors, e.g. HF-named weights).
        meta: free-form JSON metadata from the caller (parallel layout, weight version, ...).
    """

    step: int
    world_size: int
    files: dict[str, FileEntry]
    global_tensors: dict[str, GlobalTensorEntry]
    meta: dict[str, Any]
    created_unix: float
    format: str = FORMAT

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @staticmethod
    def from_json(text: str, where: str) -> Manifest:
        """Parse manifest text; `where` (its path) names the culprit in errors."""
        try:
            raw = json.loads(text)
            if raw.get("format") != FORMAT:
                raise ValueError(f"format {raw.get('format')!r} is not {FORMAT!r}")
            return Manifest(
                step=int(raw["step"]),
                world_size=int(raw["world_size"]),
                files={k: FileEntry(**v) for k, v in raw["files"].items()},
                global_tensors={
                    k: GlobalTensorEntry(shape=list(v["shape"]), dtype=str(v["dtype"]),
                                         pieces=[PieceEntry(**p) for p in v["pieces"]])
                    for k, v in raw["global_tensors"].items()
                },
                meta=dict(raw["meta"]),
                created_unix=float(raw["created_unix"]),
                format=raw["format"],
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{where}: not a valid checkpoint manifest ({exc})") from exc


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file's content, read in 16 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def fsync_dir(path: Path) -> None:
    """Make a rename/creation inside `path` durable (POSIX needs the directory itself fsynced)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_durable(path: Path, data: bytes) -> FileEntry:
    """Write `data` to `path`, fsync it, and return its FileEntry."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return FileEntry(sha256=hashlib.sha256(data).hexdigest(), bytes=len(data))


def read_latest(root: Path) -> str | None:
    """The directory name `latest` points to, or None when there is no pointer."""
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    name = pointer.read_text().strip()
    return name or None


def commit(tmp_dir: Path, manifest: Manifest) -> tuple[Path, bool]:
    """Publish a fully written temporary checkpoint directory as `step_N` and point `latest` at it.

    Order: manifest written and fsynced -> tmp dir fsynced -> rename to `step_N` -> root fsynced ->
    `latest.tmp` written and renamed over `latest` -> root fsynced. Returns the final path and whether
    an existing `step_N` was replaced.

    An existing `step_N` (a run re-done from an earlier checkpoint reaches the same step again) is
    replaced: it is first renamed to a temporary name, which start-up clean-up removes should a crash
    come before the new directory is in place; the older checkpoints stay intact throughout.
    """
    root = tmp_dir.parent
    final = root / step_dir_name(manifest.step)
    write_file_durable(tmp_dir / MANIFEST, manifest.to_json().encode())
    fsync_dir(tmp_dir)
    replaced = None
    if final.exists():
        replaced = root / f"{_TMP_PREFIX}replaced-{final.name}-{uuid.uuid4().hex[:12]}"
        os.rename(final, replaced)
    os.rename(tmp_dir, final)
    fsync_dir(root)
    pointer_tmp = root / f"{LATEST}.{uuid.uuid4().hex[:8]}.tmp"
    write_file_durable(pointer_tmp, final.name.encode())
    os.replace(pointer_tmp, root / LATEST)
    fsync_dir(root)
    if replaced is not None:
        shutil.rmtree(replaced, ignore_errors=True)
    return final, replaced is not None


def list_step_dirs(root: Path) -> list[tuple[int, Path]]:
    """`(step, path)` of every `step_N` directory under `root`, oldest first (complete or not)."""
    if not root.is_dir():
        return []
    found = [(step, p) for p in root.iterdir() if p.is_dir() and (step := parse_step(p.name)) is not None]
    return sorted(found)


def load_manifest(ckpt: Path) -> Manifest:
    """Read and parse `<ckpt>/manifest.json` (FileNotFoundError when the checkpoint is incomplete)."""
    path = ckpt / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"{ckpt} has no {MANIFEST}: it is not a complete checkpoint")
    return Manifest.from_json(path.read_text(), str(path))


def check_complete(ckpt: Path) -> Manifest:
    """Cheap completeness check (no hashing): manifest valid and every listed file present at its size.

    Raises ValueError / FileNotFoundError naming the first problem found.
    """
    manifest = load_manifest(ckpt)
    for rel, entry in manifest.files.items():
        path = ckpt / rel
        if not path.is_file():
            raise FileNotFoundError(f"{ckpt}: file {rel} listed in the manifest is missing")
        size = path.stat().st_size
        if size != entry.bytes:
            raise ValueError(f"{ckpt}: file {rel} has {size} bytes, the manifest says {entry.bytes} (truncated?)")
    return manifest


def clean_stale_tmp(root: Path) -> list[Path]:
    """Remove temporary directories left by interrupted saves; returns what was removed.

    Call only when no save of this root is in flight (at start-up, before the first save).
    """
    if not root.is_dir():
        return []
    stale = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(_TMP_PREFIX)]
    stale += [p for p in root.iterdir() if p.is_file() and p.name.startswith(f"{LATEST}.") and p.suffix == ".tmp"]
    for path in stale:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    return stale


def retention_victims(steps: Iterable[int], keep_last: int, keep_every: int, protected: Iterable[int]) -> list[int]:
    """Steps to delete: all but the newest `keep_last`, the multiples of `keep_every` and `protected`.

    Args:
        steps: committed checkpoint steps.
        keep_last: newest checkpoints always kept (>= 1; 0 keeps everything).
        keep_every: every step divisible by it is kept forever (0: none).
        protected: steps never deleted (the one `latest` points to).
    """
    if keep_last < 0 or keep_every < 0:
        raise ValueError(f"checkpoint.keep_last={keep_last} and checkpoint.keep_every={keep_every} must be >= 0")
    ordered = sorted(set(steps))
    if keep_last == 0:
        return []
    keep = set(ordered[-keep_last:]) | set(protected)
    if keep_every > 0:
        keep |= {s for s in ordered if s % keep_every == 0}
    return [s for s in ordered if s not in keep]


def apply_retention(root: Path, keep_last: int, keep_every: int) -> list[Path]:
    """Delete committed checkpoints that `retention_victims` selects; returns the deleted paths.

    The checkpoint `latest` points to is never deleted; temporary directories are never touched.
    """
    dirs = dict(list_step_dirs(root))
    latest = read_latest(root)
    protected = [s for s, p in dirs.items() if p.name == latest]
    removed = []
    for step in retention_victims(dirs, keep_last, keep_every, protected):
        # Drop the manifest first: a crash mid-delete leaves an incomplete dir that resume skips.
        (dirs[step] / MANIFEST).unlink(missing_ok=True)
        shutil.rmtree(dirs[step], ignore_errors=True)
        removed.append(dirs[step])
    return removed
