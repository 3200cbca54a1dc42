"""Persistent host buffers for checkpoint snapshots, reserved ahead of the first save.

The snapshot copies a rank's state into host memory inside the training step, so that training may
go on while a thread writes the files. Allocating that memory is the slow part of the first save:
pinning ~7 GB (bf16 weights, fp32 master weights, Adam moments of a 0.5B model) takes seconds,
while copying into buffers that exist takes milliseconds. `reserve` therefore allocates an arena
on a background thread as soon as the trainer knows its state's size; the first snapshot carves
its buffers out of it (waiting only for whatever part of the reservation is not done yet).

Pinned memory is allocated in chunks, each at most `CHUNK_BYTES` unless a single tensor is larger,
so no one allocation holds the driver for long. Without CUDA there is nothing to pin: the arena is
plain memory, touched once by the reserving thread so that the first copy does not page-fault it in.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

CHUNK_BYTES = 1 << 30
ALIGN = 256  # bytes: every carved buffer starts at a multiple, so any dtype view is aligned


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def pack_first_fit(sizes: Sequence[int], capacity: int) -> list[list[int]]:
    """Indices of `sizes` packed into bins of `capacity` bytes, first fit in decreasing size order.

    The same multiset of sizes always packs the same way, which is what lets a reservation made
    from predicted sizes hold the real tensors exactly.
    """
    order = sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        need = _aligned(sizes[i])
        for b, left in enumerate(room):
            if need <= left:
                bins[b].append(i)
                room[b] -= need
                break
        else:
            bins.append([i])
            room.append(max(capacity, need) - need)
    return bins


class HostBuffers:
    """Host copies of the tensors being checkpointed, one buffer per key, reused from save to save.

    With CUDA the buffers are pinned so device-to-host copies run asynchronously (the writer waits
    on a CUDA event); on a CPU-only machine a plain copy is the snapshot.

    Attributes:
        pinned: whether buffers are page-locked (CUDA available).
        allocations / allocated_bytes: buffers (and their bytes) allocated by `stage_all` itself, i.e.
            not carved from a reservation: allocations inside the training step.
        reserved_bytes: size of the arena `reserve` allocated (0 before, or while it runs).
    """

    def __init__(self, pinned: bool | None = None, chunk_bytes: int = CHUNK_BYTES) -> None:
        self.pinned = torch.cuda.is_available() if pinned is None else pinned
        self.chunk_bytes = chunk_bytes
        self._buffers: dict[str, Tensor] = {}
        self._chunks: list[Tensor] = []  # uint8 arena chunks
        self._free: list[int] = []  # bytes left at the end of each chunk
        self._reserving: threading.Thread | None = None
        self._reserve_error: BaseException | None = None
        self.allocations = 0
        self.allocated_bytes = 0
        self.reserved_bytes = 0

    # ---- reservation ----------------------------------------------------------------------------

    def reserve(self, sizes: Iterable[int]) -> None:
        """Start allocating an arena that holds tensors of `sizes` bytes (background thread).

        `sizes` are the expected snapshot tensors' byte sizes; the arena packs them first fit in
        decreasing order into chunks, the packing `stage_all` repeats on the real tensors.
        """
        if self._reserving is not None or self._chunks:
            raise RuntimeError("host buffers are already reserved")
        sizes = [int(s) for s in sizes]
        if any(s < 0 for s in sizes):
            raise ValueError("reserve: sizes must be >= 0")
        chunk_sizes = [sum(_aligned(sizes[i]) for i in b) for b in pack_first_fit(sizes, self.chunk_bytes)]
        self._reserving = threading.Thread(target=self._allocate_arena, args=(chunk_sizes,),
                                           name="ckpt-host-reserve", daemon=True)
        self._reserving.start()

    def _allocate_arena(self, chunk_sizes: list[int]) -> None:
        try:
            chunks = []
            for size in chunk_sizes:
                chunk = torch.empty(size, dtype=torch.uint8, pin_memory=self.pinned)
                if not self.pinned:
                    chunk.zero_()  # fault the pages in here rather than in the first snapshot's copy
                chunks.append(chunk)
            self._chunks = chunks
            self._free = [c.numel() for c in chunks]
            self.reserved_bytes = sum(chunk_sizes)
        except BaseException as exc:  # surfaced by wait_reserved; the snapshot then allocates itself
            self._reserve_error = exc

    def wait_reserved(self) -> None:
        """Block until a reservation in progress is done (re-raising its failure once)."""
        if self._reserving is not None:
            self._reserving.join()
            self._reserving = None
        if self._reserve_error is not None:
            error, self._reserve_error = self._reserve_error, None
            raise RuntimeError(f"reserving checkpoint host buffers failed: {error}") from error

    @property
    def reserving(self) -> bool:
        return self._reserving is not None and self._reserving.is_alive()

    # ---- staging --------------------------------------------------------------------------------

    def _carve(self, nbytes: int) -> Tensor | None:
        """A `nbytes` uint8 slice of the arena (first fit), or None when no chunk has room."""
        need = _aligned(nbytes)
        for c, left in enumerate(self._free):
            if need <= left:
                start = self._chunks[c].numel() - left
                self._free[c] -= need
                return self._chunks[c][start:start + nbytes]
        return None

    def _new_buffer(self, src: Tensor) -> Tensor:
        nbytes = src.numel() * src.element_size()
        raw = self._carve(nbytes)
        if raw is None:
            self.allocations += 1
            self.allocated_bytes += nbytes
            return torch.empty(src.shape, dtype=src.dtype, device="cpu", pin_memory=self.pinned and src.is_cuda)
        return raw.view(src.dtype).view(src.shape) if nbytes else torch.empty(src.shape, dtype=src.dtype)

    def stage_all(self, items: Sequence[tuple[str, Tensor]], keep: Iterable[str] = ()) -> dict[str, Tensor]:
        """Host copies of every `(key, tensor)`, in buffers reused by key (new ones carved first fit,
        largest first, like the reservation) and dropping buffers of keys no longer staged (but those in
        `keep`: keys copied elsewhere this time, whose buffers the next snapshot may need again)."""
        self.wait_reserved()
        sources = [(key, t.detach()) for key, t in items]
        missing = [i for i, (key, src) in enumerate(sources)
                   if (buf := self._buffers.get(key)) is None or buf.shape != src.shape or buf.dtype != src.dtype]
        sizes = [sources[i][1].numel() * sources[i][1].element_size() for i in missing]
        for i in sorted(range(len(missing)), key=lambda j: (-sizes[j], j)):
            key, src = sources[missing[i]]
            self._buffers[key] = self._new_buffer(src)
        out: dict[str, Tensor] = {}
        for key, src in sources:
            buf = self._buffers[key]
            buf.copy_(src, non_blocking=src.is_cuda)
            out[key] = buf
        for key in set(self._buffers) - set(out) - set(keep):
            del self._buffers[key]
        return out

    def clear(self) -> None:
        self.wait_reserved_quietly()
        self._buffers.clear()
        self._chunks, self._free = [], []
        self.reserved_bytes = 0

    def wait_reserved_quietly(self) -> None:
        """Join a reservation in progress, dropping its error (used when tearing down)."""
        if self._reserving is not None:
            self._reserving.join()
            self._reserving = None
        self._reserve_error = None

    def __len__(self) -> int:
        return len(self._buffers)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())
