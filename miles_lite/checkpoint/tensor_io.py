"""Tensor serialisation for checkpoints: object trees with tensors split out, streamed safetensors files.

Tensors are written in the safetensors format (readable by `safetensors.safe_open`, memory-mapped
at load), one pass per file that feeds the same bytes to the file and to sha256, so a save reads
its host buffers exactly once. Everything else in a state tree (ints, dicts, numpy RNG states)
goes through pickle, with each tensor replaced by a `TensorRef` to its key in the tensor file.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from miles_lite.checkpoint.layout import FileEntry

_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
_CHUNK = 16 << 20


@dataclass(frozen=True)
class TensorRef:
    """Placeholder left in a pickled object tree where a tensor was: its key in the tensor file."""

    key: str


def dtype_name(dtype: torch.dtype) -> str:
    """safetensors dtype code of a torch dtype (ValueError for dtypes it cannot hold)."""
    if dtype not in _DTYPES:
        raise ValueError(f"tensor dtype {dtype} cannot be checkpointed; supported: {sorted(map(str, _DTYPES))}")
    return _DTYPES[dtype]


def torch_dtype(name: str) -> torch.dtype:
    """Inverse of `dtype_name`."""
    for dtype, code in _DTYPES.items():
        if code == name:
            return dtype
    raise ValueError(f"unknown checkpoint dtype code {name!r}")


def split_tensors(tree: Any, prefix: str, out: dict[str, Tensor]) -> Any:
    """Copy of `tree` (dicts, lists, tuples nested) with every tensor moved into `out` as a `TensorRef`.

    Keys are `prefix` + the path of the tensor in the tree, e.g. `local/rng/torch`. Dict keys may be
    any picklable value; they are stringified only inside the tensor key.
    """
    if isinstance(tree, Tensor):
        if prefix in out:
            raise ValueError(f"two tensors map to checkpoint key {prefix!r}; rename one of the state entries")
        out[prefix] = tree
        return TensorRef(prefix)
    if isinstance(tree, Mapping):
        return {k: split_tensors(v, f"{prefix}/{k}", out) for k, v in tree.items()}
    if isinstance(tree, list):
        return [split_tensors(v, f"{prefix}/{i}", out) for i, v in enumerate(tree)]
    if isinstance(tree, tuple) and not hasattr(tree, "_fields"):
        return tuple(split_tensors(v, f"{prefix}/{i}", out) for i, v in enumerate(tree))
    return tree


def join_tensors(tree: Any, lookup: Callable[[str], Tensor]) -> Any:
    """Inverse of `split_tensors`: replace each `TensorRef` by `lookup(key)`."""
    if isinstance(tree, TensorRef):
        return lookup(tree.key)
    if isinstance(tree, dict):
        return {k: join_tensors(v, lookup) for k, v in tree.items()}
    if isinstance(tree, list):
        return [join_tensors(v, lookup) for v in tree]
    if isinstance(tree, tuple) and not hasattr(tree, "_fields"):
        return tuple(join_tensors(v, lookup) for v in tree)
    return tree


def _header(tensors: Mapping[str, Tensor], metadata: Mapping[str, str]) -> bytes:
    entries: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for key, t in tensors.items():
        size = t.numel() * t.element_size()
        entries[key] = {"dtype": dtype_name(t.dtype), "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(entries, separators=(",", ":")).encode()
    # The format wants the data start 8-byte aligned; the header may be padded with spaces.
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw


def _as_bytes(t: Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, without a copy."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("tensor files are written from contiguous host buffers (snapshot first)")
    flat = t.reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def write_safetensors(path: Path, tensors: Mapping[str, Tensor],
                      metadata: Mapping[str, str] | None = None) -> FileEntry:
    """Stream `tensors` (contiguous, on CPU) into a safetensors file, fsync it, return size and sha256.

    The file is readable by `safetensors.safe_open(path, "pt")`. Keys keep the mapping's order.
    """
    digest = hashlib.sha256()
    total = 0
    with open(path, "wb") as f:
        head = _header(tensors, metadata or {})
        digest.update(head)
        f.write(head)
        total += len(head)
        for t in tensors.values():
            view = _as_bytes(t)
            for start in range(0, len(view), _CHUNK):
                chunk = view[start:start + _CHUNK]
                # Both calls release the GIL on large buffers, so the training thread keeps running.
                digest.update(chunk)
                f.write(chunk)
            total += len(view)
        f.flush()
        os.fsync(f.fileno())
    return FileEntry(sha256=digest.hexdigest(), bytes=total)


def read_safetensors(path: Path) -> dict[str, Tensor]:
    """All tensors of a safetensors file (CPU)."""
    from safetensors.torch import load_file

    return load_file(str(path), device="cpu")
