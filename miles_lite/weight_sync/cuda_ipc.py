"""CUDA IPC through the driver API alone, so that two processes with different torch builds share memory.

torch's own IPC (`ForkingPickler` of a CUDA tensor) pickles torch-internal rebuild functions, a
reference-count file and an event handle: both sides must agree on torch's internals. Here the
exporter allocates a plain device buffer with `cuMemAlloc`, exports its 64-byte `CUipcMemHandle`,
and the importer maps it with `cuIpcOpenMemHandle` and wraps the pointer as a tensor through the
`__cuda_array_interface__` protocol, which every torch build reads. Both sides load the same
`libcuda.so.1` (the driver), whatever CUDA runtime their torch ships.

The push request travels as JSON in the *name* of one empty tensor (an empty tensor pickles as plain
bytes, without shared memory): `{"handle", "size", "tensors": [[param, offset, dtype, shape], ...]}`.
"""

from __future__ import annotations

import base64
import ctypes
import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

REQUEST_PREFIX = "miles_lite.ipc_push:"
HANDLE_BYTES = 64
CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1
ALIGN = 256
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class CudaDriverError(RuntimeError):
    """A CUDA driver call failed; the message names the call and the driver's error string."""


class CUipcMemHandle(ctypes.Structure):
    """`CUipcMemHandle`: 64 opaque bytes, passed by value to `cuIpcOpenMemHandle`."""

    _fields_ = [("reserved", ctypes.c_char * HANDLE_BYTES)]


@functools.cache
def driver() -> ctypes.CDLL:
    """The CUDA driver library (the same file for every torch build on the machine), with the
    signatures of the calls used here."""
    lib = ctypes.CDLL("libcuda.so.1")
    ptr, u64 = ctypes.POINTER(ctypes.c_uint64), ctypes.c_uint64
    lib.cuMemAlloc_v2.argtypes = [ptr, ctypes.c_size_t]
    lib.cuMemFree_v2.argtypes = [u64]
    lib.cuIpcGetMemHandle.argtypes = [ctypes.POINTER(CUipcMemHandle), u64]
    lib.cuIpcOpenMemHandle_v2.argtypes = [ptr, CUipcMemHandle, ctypes.c_uint]
    lib.cuIpcCloseMemHandle.argtypes = [u64]
    lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    for fn in (lib.cuMemAlloc_v2, lib.cuMemFree_v2, lib.cuIpcGetMemHandle, lib.cuIpcOpenMemHandle_v2,
               lib.cuIpcCloseMemHandle, lib.cuGetErrorString):
        fn.restype = ctypes.c_int
    return lib


def _check(result: int, call: str) -> None:
    if result != 0:
        msg = ctypes.c_char_p()
        driver().cuGetErrorString(result, ctypes.byref(msg))
        raise CudaDriverError(f"{call} failed: CUDA error {result} ({(msg.value or b'?').decode()})")


def _bind_context(device: torch.device) -> None:
    """Make torch's primary context current on this thread (driver calls act on the current context)."""
    torch.cuda.set_device(device)
    torch.cuda.synchronize(device)


class _CudaArray:
    """`__cuda_array_interface__` (version 2: no stream semantics) of raw device bytes."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "strides": None, "version": 2}


def wrap_pointer(ptr: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 tensor over `nbytes` device bytes at `ptr` (no copy; the memory stays owned elsewhere)."""
    t = torch.as_tensor(_CudaArray(ptr, nbytes), device=device)
    if t.data_ptr() != ptr:
        raise CudaDriverError("torch copied the shared buffer instead of wrapping it")
    return t


class ExportedBuffer:
    """Device memory of the exporting process that other processes can map by its IPC handle.

    Allocated with `cuMemAlloc`, outside torch's caching allocator: its IPC handle stays valid for the
    buffer's whole life and the importer maps exactly this allocation (offset 0).
    """

    def __init__(self, nbytes: int, device: torch.device | str = "cuda") -> None:
        if nbytes <= 0:
            raise ValueError(f"shared buffer size must be > 0 bytes, got {nbytes}")
        self.device = torch.device(device)
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        _bind_context(self.device)
        ptr = ctypes.c_uint64()
        _check(driver().cuMemAlloc_v2(ctypes.byref(ptr), nbytes), "cuMemAlloc")
        self.ptr, self.nbytes = ptr.value, nbytes
        handle = CUipcMemHandle()
        _check(driver().cuIpcGetMemHandle(ctypes.byref(handle), self.ptr), "cuIpcGetMemHandle")
        self.handle = bytes(ctypes.string_at(ctypes.addressof(handle), HANDLE_BYTES))
        self.tensor: torch.Tensor | None = wrap_pointer(self.ptr, nbytes, self.device)

    def close(self) -> None:
        """Free the memory (after the device is idle); importers must have closed their mappings."""
        if self.tensor is None:
            return
        self.tensor = None
        _bind_context(self.device)
        torch.cuda.synchronize(self.device)
        _check(driver().cuMemFree_v2(self.ptr), "cuMemFree")


class ImportedBuffer:
    """Another process's `ExportedBuffer`, mapped into this one (a context manager that unmaps)."""

    def __init__(self, handle: bytes, nbytes: int, device: torch.device | str = "cuda") -> None:
        if len(handle) != HANDLE_BYTES:
            raise ValueError(f"a CUDA IPC handle has {HANDLE_BYTES} bytes, got {len(handle)}")
        self.device = torch.device(device)
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        _bind_context(self.device)
        raw = CUipcMemHandle.from_buffer_copy(handle)
        ptr = ctypes.c_uint64()
        _check(driver().cuIpcOpenMemHandle_v2(ctypes.byref(ptr), raw, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS),
               "cuIpcOpenMemHandle")
        self.ptr = ptr.value
        self.tensor: torch.Tensor | None = wrap_pointer(self.ptr, nbytes, self.device)

    def close(self) -> None:
        """Wait for this process's work on the mapping, then unmap it."""
        if self.tensor is None:
            return
        self.tensor = None
        torch.cuda.synchronize(self.device)
        _check(driver().cuIpcCloseMemHandle(self.ptr), "cuIpcCloseMemHandle")

    def __enter__(self) -> ImportedBuffer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# ---- the push request -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Slot:
    """One parameter's bytes inside the shared buffer: `param` (engine name), byte `offset`, dtype, shape."""

    param: str
    offset: int
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty(0, dtype=DTYPES[self.dtype]).element_size()


def layout_slots(named: Sequence[tuple[str, torch.Tensor]]) -> tuple[list[Slot], int]:
    """Byte offsets of `named` tensors packed one after another (ALIGN-aligned); (slots, total bytes)."""
    slots, offset = [], 0
    for name, t in named:
        dtype = str(t.dtype).removeprefix("torch.")
        if dtype not in DTYPES:
            raise ValueError(f"{name}: dtype {t.dtype} cannot be pushed by IPC; use one of {sorted(DTYPES)}")
        slots.append(Slot(name, offset, dtype, tuple(int(s) for s in t.shape)))
        offset += (t.numel() * t.element_size() + ALIGN - 1) // ALIGN * ALIGN
    return slots, offset


def slot_view(base: torch.Tensor, slot: Slot) -> torch.Tensor:
    """The typed, shaped view of `slot` inside the uint8 buffer `base`."""
    return base[slot.offset:slot.offset + slot.nbytes].view(DTYPES[slot.dtype]).view(slot.shape)


def encode_request(handle: bytes, nbytes: int, slots: Sequence[Slot]) -> list[tuple[str, torch.Tensor]]:
    """The `named_tensors` of one push: an empty tensor whose name carries handle and slots."""
    body = {"handle": base64.b64encode(handle).decode("ascii"), "size": int(nbytes),
            "tensors": [[s.param, s.offset, s.dtype, list(s.shape)] for s in slots]}
    return [(REQUEST_PREFIX + json.dumps(body, separators=(",", ":")), torch.empty(0, dtype=torch.uint8))]


def decode_request(named_tensors: Sequence[tuple[str, Any]]) -> tuple[bytes, int, list[Slot]]:
    """(handle, buffer bytes, slots) of a push; ValueError naming what is wrong with anything else."""
    items = list(named_tensors)
    if len(items) != 1 or not isinstance(items[0][0], str) or not items[0][0].startswith(REQUEST_PREFIX):
        raise ValueError(f"the IPC weight loader takes one tensor named {REQUEST_PREFIX!r}...; got {len(items)} "
                         f"tensors named e.g. {[str(n)[:60] for n, _ in items[:3]]}")
    body = json.loads(items[0][0][len(REQUEST_PREFIX):])
    handle, size = base64.b64decode(body["handle"]), int(body["size"])
    slots = [Slot(str(p), int(o), str(d), tuple(int(x) for x in shape)) for p, o, d, shape in body["tensors"]]
    for s in slots:
        if s.dtype not in DTYPES or s.offset < 0 or s.offset + s.nbytes > size:
            raise ValueError(f"IPC push slot {s} does not fit the {size}-byte buffer")
    return handle, size, slots
