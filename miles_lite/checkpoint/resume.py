"""Finding the checkpoint to resume from, and reading it back with every file's checksum verified.

`checkpoint.resume`: `auto` takes the newest *intact* checkpoint under `checkpoint.dir` (manifest
valid, every listed file present with its recorded size and sha256; temporary directories are never
considered; a damaged newest checkpoint is reported and the one before it is tried), `none` starts
fresh, anything else is a path: a checkpoint directory, or a root whose newest intact checkpoint is
taken.
"""

from __future__ import annotations

import os
import pickle
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from miles_lite.checkpoint.layout import (
    ASSETS_DIR,
    MANIFEST,
    SHARED_OBJECTS,
    SUPERSEDED_DIR,
    Manifest,
    check_complete,
    list_step_dirs,
    load_manifest,
    rank_object_file,
    rank_tensor_file,
    sha256_file,
)
from miles_lite.checkpoint.tensor_io import join_tensors, torch_dtype
from miles_lite.config.schema import CheckpointConfig


class ChecksumMismatchError(RuntimeError):
    """A checkpoint file's content does not match the sha256 or size its manifest records."""


def newest_complete(root: str | Path) -> Path | None:
    """The newest checkpoint under `root` that passes `check_complete`, or None when there is none."""
    for _, path in reversed(list_step_dirs(Path(root))):
        try:
            check_complete(path)
        except (OSError, ValueError):
            continue  # an interrupted or damaged save: fall back to the one before
        return path
    return None


def verify_checkpoint(path: str | Path) -> Manifest:
    """Read every file of checkpoint `path` and check its size and sha256 against the manifest.

    Raises FileNotFoundError (incomplete), ValueError (bad manifest) or ChecksumMismatchError, naming
    the file and the expected and actual values.
    """
    return CheckpointReader(path).manifest


def newest_intact(root: str | Path, log: Callable[[str], None] = print) -> Path | None:
    """The newest checkpoint under `root` whose every file verifies, saying why each newer one was passed over."""
    for _, path in reversed(list_step_dirs(Path(root))):
        try:
            verify_checkpoint(path)
        except (OSError, ValueError, ChecksumMismatchError) as err:
            log(f"checkpoint {path} cannot be resumed ({err}); trying the one before")
            continue
        return path
    return None


def resolve_resume(cfg: CheckpointConfig, log: Callable[[str], None] = print) -> Path | None:
    """The checkpoint directory `checkpoint.resume` selects, or None to start fresh.

    `auto` and a root directory take the newest checkpoint whose files all verify (sha256), falling back
    past damaged ones; an explicit checkpoint directory is taken as named (its reader verifies it).
    Raises FileNotFoundError when `resume` names a path holding no intact checkpoint.
    """
    choice = cfg.resume.strip()
    if choice in ("", "none"):
        return None
    if choice == "auto":
        return newest_intact(cfg.dir, log) if cfg.dir else None
    path = Path(choice)
    if (path / MANIFEST).is_file():
        return path
    found = newest_intact(path, log) if path.is_dir() else None
    if found is None:
        raise FileNotFoundError(
            f"checkpoint.resume={choice!r} is neither a checkpoint directory (with {MANIFEST}) nor a root "
            "holding an intact step_N checkpoint; set checkpoint.resume=auto|none or a valid path"
        )
    return found


def set_aside_newer(root: str | Path, step: int, log: Callable[[str], None] = print) -> list[Path]:
    """Move the `step_N` directories of `root` newer than `step` to `root/superseded/`; returns their new paths.

    A run resumed from step `step` writes its own checkpoints after it: the newer ones belong to the
    continuation it replaces (or are damaged) and must not be taken by a later `resume=auto`, nor
    make retention delete the new checkpoints as the older ones. They are moved, never deleted.
    """
    newer = [(s, p) for s, p in list_step_dirs(Path(root)) if s > step]
    if not newer:
        return []
    target = Path(root) / SUPERSEDED_DIR / time.strftime("%Y%m%d-%H%M%S")
    target.mkdir(parents=True, exist_ok=True)
    moved = []
    for _, path in newer:
        dest = target / path.name
        os.rename(path, dest)
        moved.append(dest)
    log(f"resuming at step {step}: the newer checkpoints {', '.join(p.name for _, p in newer)} were moved to "
        f"{target} (the run continues from step {step} and writes its own; delete them when not needed)")
    return moved


class CheckpointReader:
    """Read access to one committed checkpoint.

    Args:
        path: the checkpoint directory (`.../step_N`).
        verify: check every file's size and sha256 against the manifest at open (raises
            ChecksumMismatchError naming the file, the expected and the actual value).
    """

    def __init__(self, path: str | Path, verify: bool = True) -> None:
        self.path = Path(path)
        self.manifest: Manifest = check_complete(self.path) if not verify else self._verified()
        self._files: dict[str, Any] = {}

    def _verified(self) -> Manifest:
        manifest = load_manifest(self.path)
        for rel, entry in sorted(manifest.files.items()):
            path = self.path / rel
            if not path.is_file():
                raise FileNotFoundError(f"checkpoint {self.path}: file {rel} listed in the manifest is missing")
            size = path.stat().st_size
            if size != entry.bytes:
                raise ChecksumMismatchError(f"checkpoint {self.path}: file {rel} is {size} bytes, expected "
                                            f"{entry.bytes} (truncated or overwritten)")
            actual = sha256_file(path)
            if actual != entry.sha256:
                raise ChecksumMismatchError(f"checkpoint {self.path}: file {rel} has sha256 {actual}, expected "
                                            f"{entry.sha256} (corrupted)")
        return manifest

    @property
    def step(self) -> int:
        return self.manifest.step

    @property
    def meta(self) -> dict[str, Any]:
        return self.manifest.meta

    def _handle(self, fname: str) -> Any:
        from safetensors import safe_open

        if fname not in self._files:
            self._files[fname] = safe_open(str(self.path / fname), framework="pt", device="cpu")
        return self._files[fname]

    def _tensor(self, fname: str, key: str) -> Tensor:
        return self._handle(fname).get_tensor(key)

    # ---- layout-independent tensors ---------------------------------------------------------------

    def global_names(self, prefix: str = "") -> list[str]:
        """Names of the stored global tensors starting with `prefix`, sorted."""
        return sorted(n for n in self.manifest.global_tensors if n.startswith(prefix))

    def has_global(self, name: str) -> bool:
        return name in self.manifest.global_tensors

    def global_shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._entry(name).shape)

    def _entry(self, name: str) -> Any:
        if name not in self.manifest.global_tensors:
            raise KeyError(f"checkpoint {self.path} has no global tensor {name!r}")
        return self.manifest.global_tensors[name]

    def global_slice(self, name: str, dim: int = 0, start: int = 0, stop: int | None = None) -> Tensor:
        """Rows `[start, stop)` along `dim` of global tensor `name`, read from the pieces that overlap.

        Works whatever layout wrote the pieces (pieces sliced along another dim are read whole).
        """
        entry = self._entry(name)
        shape = list(entry.shape)
        if not shape:
            piece = entry.pieces[0]
            return self._tensor(piece.file, piece.key).clone()
        stop = shape[dim] if stop is None else stop
        if not 0 <= start <= stop <= shape[dim]:
            raise ValueError(f"{name}: slice [{start}, {stop}) outside [0, {shape[dim]}) of dim {dim}")
        out_shape = list(shape)
        out_shape[dim] = stop - start
        out = torch.empty(out_shape, dtype=torch_dtype(entry.dtype))
        for piece in entry.pieces:
            if piece.dim != dim:
                # Assemble the overlap through the piece's own dim.
                part = self._tensor(piece.file, piece.key).narrow(dim, start, stop - start)
                out.narrow(piece.dim, piece.start, piece.stop - piece.start).copy_(part)
                continue
            lo, hi = max(start, piece.start), min(stop, piece.stop)
            if lo >= hi:
                continue
            part = self._tensor(piece.file, piece.key).narrow(dim, lo - piece.start, hi - lo)
            out.narrow(dim, lo - start, hi - lo).copy_(part)
        return out

    def global_tensor(self, name: str) -> Tensor:
        """The whole global tensor `name`."""
        return self.global_slice(name)

    # ---- object trees ---------------------------------------------------------------------------

    def _tree(self, fname: str, tensor_file: str) -> Any:
        with open(self.path / fname, "rb") as f:
            tree = pickle.load(f)  # noqa: S301 - our own manifest-verified file
        return join_tensors(tree, lambda key: self._tensor(tensor_file, key).clone())

    def shared(self) -> dict[str, Any]:
        """The tree rank 0 saved as `shared` (empty when it saved none)."""
        if SHARED_OBJECTS not in self.manifest.files:
            return {}
        return self._tree(SHARED_OBJECTS, rank_tensor_file(0))

    def local(self, rank: int) -> dict[str, Any] | None:
        """The private tree rank `rank` saved, or None when the checkpoint had fewer ranks."""
        if not 0 <= rank < self.manifest.world_size:
            return None
        return self._tree(rank_object_file(rank), rank_tensor_file(rank))

    def asset_dir(self) -> Path:
        """Directory of the assets stored at save time (HF config, tokenizer files)."""
        return self.path / ASSETS_DIR

    def assets(self) -> Iterator[str]:
        prefix = f"{ASSETS_DIR}/"
        return (rel[len(prefix):] for rel in self.manifest.files if rel.startswith(prefix))

    def close(self) -> None:
        self._files.clear()
