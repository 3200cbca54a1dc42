"""What one rank hands to the checkpointer: layout-independent tensor pieces, private and shared state.

Resharding design: tensors whose placement depends on the parallel layout (TP shards of weights
and of their Adam moments) are stored as *pieces of global tensors*: each piece says which rows
`[start, stop)` along which `dim` of the full tensor it holds. The trainer names global tensors by
their Hugging Face names, whose full shapes do not depend on TP (fused QKV / gate-up and vocabulary
padding are undone by the trainer's `ParamLayout.split`). Loading under any TP then reads the
pieces overlapping the slice a rank needs. State that only makes sense on the rank that wrote it
(RNG streams) is `local`; state identical on every rank (scheduler, counters, driver state) is
`shared`, written once by rank 0.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import Tensor


@dataclass(frozen=True)
class GlobalPiece:
    """Rows `[start, start + tensor.shape[dim])` along `dim` of global tensor `name` (full shape `global_shape`).

    Args:
        name: layout-independent tensor name (e.g. `model/model.layers.0.mlp.up_proj.weight`).
        tensor: the piece; its shape equals `global_shape` except along `dim`.
        global_shape: shape of the whole tensor.
        dim: dimension the piece is a slice of.
        start: first index along `dim`.
    """

    name: str
    tensor: Tensor
    global_shape: tuple[int, ...]
    dim: int = 0
    start: int = 0

    def __post_init__(self) -> None:
        shape = tuple(self.tensor.shape)
        if len(shape) != len(self.global_shape):
            raise ValueError(f"GlobalPiece {self.name!r}: piece rank {len(shape)} != global rank "
                             f"{len(self.global_shape)} (global_shape={self.global_shape})")
        if len(shape) == 0:
            if self.dim != 0 or self.start != 0:
                raise ValueError(f"GlobalPiece {self.name!r}: a 0-d tensor is whole (dim=0, start=0)")
            return
        if not 0 <= self.dim < len(shape):
            raise ValueError(f"GlobalPiece {self.name!r}: dim={self.dim} outside a {len(shape)}-d tensor")
        for d, (have, full) in enumerate(zip(shape, self.global_shape, strict=True)):
            if d != self.dim and have != full:
                raise ValueError(f"GlobalPiece {self.name!r}: shape {shape} differs from global "
                                 f"{self.global_shape} outside dim {self.dim}")
        if self.start < 0 or self.stop > self.global_shape[self.dim]:
            raise ValueError(f"GlobalPiece {self.name!r}: rows [{self.start}, {self.stop}) outside "
                             f"[0, {self.global_shape[self.dim]}) of dim {self.dim}")

    @property
    def stop(self) -> int:
        return self.start + (self.tensor.shape[self.dim] if self.tensor.dim() else 1)

    @staticmethod
    def whole(name: str, tensor: Tensor) -> GlobalPiece:
        """A piece that is the entire global tensor."""
        return GlobalPiece(name=name, tensor=tensor, global_shape=tuple(tensor.shape))


@dataclass
class CheckpointPayload:
    """One rank's contribution to a checkpoint.

    Attributes:
        pieces: global-tensor pieces this rank writes (each piece written by exactly one rank is
            enough; duplicates are allowed and de-duplicated by position).
        local: this rank's private state tree (dicts/lists/tuples of tensors and picklable values).
        shared: rank 0 only: the state tree every rank reads back (other ranks pass None).
        assets: rank 0 only: files stored under `hf/` (relative path -> bytes or a source file).
        meta: rank 0 only: JSON-serialisable metadata recorded in the manifest.
    """

    pieces: Sequence[GlobalPiece] = ()
    local: Mapping[str, Any] = field(default_factory=dict)
    shared: Mapping[str, Any] | None = None
    assets: Mapping[str, bytes | Path] | None = None
    meta: Mapping[str, Any] | None = None
