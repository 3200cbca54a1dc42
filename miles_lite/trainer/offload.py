"""Trainer state to host memory and back, while colocated engines use the device.

Three parts, each switched by `trainer.offload.<part>`:

- `params`: the model's parameters (and Megatron DDP's contiguous parameter buffers, when it keeps them);
- `grads`: Megatron DDP's contiguous gradient buffers (`param.main_grad` views into them) and any `.grad`.
  Their values are dropped, not copied: every optimizer step begins by zeroing them, so nothing reads a
  gradient across a hand-off, and copying them (fp32, twice the bf16 weights' bytes: 28 GiB at 7B) out and
  back would be most of the hand-off's time. They come back zeroed;
- `optimizer`: the torch optimizers' main parameters that are not model parameters (fp32 copies of bf16
  weights), every tensor of their state (Adam moments), and the divergence guard's snapshot buffers.

What moves is each tensor's *storage*: its bytes are copied to a host buffer (pinned when CUDA is there, so
the copies run at full PCIe speed) and the storage is resized to zero, which frees the device memory while
every tensor and view over it (parameters held by the optimizer, `main_grad` views, Megatron's bucket views)
stays the same Python object; onloading resizes the storage back and copies the bytes in, so the state
round-trips bit for bit (gradients aside, see above). On a CPU build the same path runs: the storages are
freed and restored in host memory (there is no device memory to give to an engine, but the bookkeeping and the
exactness are the same).

Each part is RESIDENT, LEAVING or OFFLOADED:

    RESIDENT ──offload──> OFFLOADED ──onload──> RESIDENT
        └──offload(wait=False)──> LEAVING ──settle──┘

Offloading an offloaded part or onloading a resident one is a no-op, so the driver may ask for "everything
resident" without tracking what was moved. An offload with `wait=False` leaves the copies of its kept parts in
flight (LEAVING): on a GPU they are queued on the offload's own stream, after the work queued on the compute
stream, and the part's storages stay allocated until `settle` waits for them, frees the storages and hands the
memory to the driver, so the device-to-host copies run while the engines resume their weights and load a push
(`run/handoff.py`). It does so only while the device keeps `keep_free` bytes free once the dropped parts are gone
(see `OverlapRoom`), else it completes as a waiting offload does. On a CPU build the copies are made at once but
the part still goes through LEAVING to `settle`, so both builds run the same bookkeeping. Whatever needs a
leaving part (an onload, another offload, `require_resident`, `ready_on_device`, `resident_bytes`) settles it
first: no reader ever sees a part half gone. Dropped parts are freed at once either way (there is no copy to
wait for; the wait for kernels still reading them comes before any copy is queued, so it does not wait for
those).

A part may also be *staged*: `stage` copies its bytes to host memory (on a GPU on the offload's stream) while it
stays RESIDENT and readable, and its next offload takes those copies instead of making its own, waiting only for
them to land; a checkpoint taken meanwhile writes them too (`staged_copies`). The hand-off stages the optimizer
state and the parameters once the optimizer step is done, before a checkpoint and its push: the push reads the
parameters, and their copies run while the engines wake, load and are verified. A staged copy stands until the part
is written: an optimizer step (`ready_on_device`) and a checkpoint restore drop it (`drop_staged`), and an offload
that finds the part's storages changed makes its own copies.

On a GPU an onload does not wait for its copies: they run on a stream of their own, and whatever reads a part
waits for that part's copies first: `require_resident` (log-probs, the weight push, checkpoints) on the host,
`ready_on_device` (the optimizer step) on the device only, so the optimizer state comes back while the step's
forward and backward run on the parameters that came back first.
"""

from __future__ import annotations

import contextlib
import enum
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from miles_lite.config.offload import DROPPED_PARTS, KEPT_PARTS, OFFLOAD_PARTS


class PartState(enum.Enum):
    RESIDENT = "resident"
    LEAVING = "leaving"  # copied (or being copied) to the host, the device storage not freed yet: see `settle`
    OFFLOADED = "offloaded"


# What `OverlapRoom` adds to its bound of the engines' weights: a factor for what the bound leaves out (vocabulary
# padding, weights the engines keep in another layout) and bytes for allocator rounding and the engines' own
# workspaces while they resume.
OVERLAP_MARGIN = 1.25
OVERLAP_SLACK_BYTES = 1 << 30


@dataclass(frozen=True)
class OverlapRoom:
    """What must stay free on a trainer device while its offload overlaps a weight push: the engines resume their
    weights there, at most `weights_scale` times the rank's resident parameter bytes (`run/handoff.py` derives
    it from the layout; 0 when they keep their weights), and the push stages up to `staging_bytes` of them
    on the trainer's side."""

    weights_scale: float
    staging_bytes: int

    def bytes_needed(self, param_bytes: int) -> int:
        return int(param_bytes * self.weights_scale * OVERLAP_MARGIN) + self.staging_bytes + OVERLAP_SLACK_BYTES


@dataclass
class _Moved:
    """One storage while it is offloaded: the storage object itself and its bytes on the host (None: dropped)."""

    storage: torch.UntypedStorage
    host: Tensor | None
    device: torch.device
    nbytes: int


@dataclass
class MoveStats:
    """What one offload or onload moved: bytes per part and wall seconds; `deferred`, for an offload that was
    free not to wait: whether it left parts LEAVING (their copies in flight until `settle`)."""

    bytes: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    deferred: bool | None = None

    def report(self) -> dict[str, float]:
        """`<part>_bytes`, `seconds` (and `deferred`, 1.0 or 0.0, when set) as floats."""
        out = {**{f"{p}_bytes": float(b) for p, b in self.bytes.items()}, "seconds": self.seconds}
        return out if self.deferred is None else {**out, "deferred": float(self.deferred)}


def _storages(tensors: Iterable[Tensor | None]) -> dict[int, tuple[torch.UntypedStorage, torch.device]]:
    """The distinct non-empty storages under `tensors`, keyed by their data pointer."""
    out: dict[int, tuple[torch.UntypedStorage, torch.device]] = {}
    for t in tensors:
        if t is None:
            continue
        storage = t.untyped_storage()
        if storage.nbytes() > 0:
            out.setdefault(storage.data_ptr(), (storage, t.device))
    return out


class TrainerOffload:
    """Moves the trainer's parts to host memory and back.

    `collectors[part]()` returns that part's tensors now (optimizer state appears after the first step, so
    they are asked at every offload). A storage listed by an earlier part in `OFFLOAD_PARTS` belongs to that
    part only: with fp32 training the optimizer's main parameters are the model's parameters.
    """

    def __init__(self, collectors: dict[str, Callable[[], Sequence[Tensor | None]]]) -> None:
        unknown = set(collectors) - set(OFFLOAD_PARTS)
        if unknown:
            raise ValueError(f"unknown trainer parts {sorted(unknown)}; known: {OFFLOAD_PARTS}")
        self.collectors = collectors
        self.states = dict.fromkeys(OFFLOAD_PARTS, PartState.RESIDENT)
        self._moved: dict[str, list[_Moved]] = {p: [] for p in OFFLOAD_PARTS}
        self.pin = torch.cuda.is_available()
        # part -> the CUDA event after its onload copies (until a host wait saw them land).
        self._pending: dict[str, Any] = {}
        # LEAVING part -> the CUDA event after its offload copies (None: they are done, on a CPU build).
        self._leaving: dict[str, Any] = {}
        # Staged part -> its storages with their bytes copied to host memory, and the event after those copies.
        self._staged: dict[str, tuple[list[_Moved], Any]] = {}
        self._copy_stream: Any = None

    def offloaded(self) -> frozenset[str]:
        """The parts away from compute memory, or on their way (LEAVING)."""
        return frozenset(p for p, s in self.states.items() if s is not PartState.RESIDENT)

    def require_resident(self, parts: Sequence[str], what: str) -> None:
        """Raise naming the offloaded `parts` that `what` needs on the device; wait (on the host) for the copies
        of an onload of them still in flight."""
        self.check_resident(parts, what)
        for part in parts:
            if (event := self._pending.pop(part, None)) is not None:
                event.synchronize()

    def check_resident(self, parts: Sequence[str], what: str) -> None:
        """Raise naming the offloaded `parts` that `what` needs on the device (one still leaving settles first)."""
        self.settle(parts)
        away = [p for p in parts if self.states[p] is PartState.OFFLOADED]
        if away:
            raise RuntimeError(f"{what} needs the trainer's {', '.join(away)} on the device, and they are offloaded "
                               "to host memory; onload them first")

    def ready_on_device(self, parts: Sequence[str], what: str) -> None:
        """Like `require_resident`, but the wait for copies in flight is the device's: work queued after this
        call runs after them, and the host goes on at once. For a writer (the optimizer step): what was staged of
        `parts` is dropped."""
        self.drop_staged(parts)
        self.check_resident(parts, what)
        for part in parts:
            if (event := self._pending.get(part)) is not None:
                torch.cuda.current_stream().wait_event(event)

    def _claimed_elsewhere(self, part: str) -> set[int]:
        """Storages of the parts before `part` (resident or not): never moved twice under two names."""
        keys: set[int] = set()
        for other in OFFLOAD_PARTS[:OFFLOAD_PARTS.index(part)]:
            if other in self.collectors:
                keys |= set(_storages(self.collectors[other]()))
        return keys

    def _collect(self, part: str) -> list[_Moved]:
        """The storages `part` would move now, each once (host buffers not made yet)."""
        skip = self._claimed_elsewhere(part)
        return [_Moved(storage, None, device, storage.nbytes())
                for key, (storage, device) in _storages(self.collectors[part]()).items() if key not in skip]

    def part_bytes(self, part: str) -> int:
        """Device bytes `part` holds now (0 unless it is resident)."""
        if self.states[part] is not PartState.RESIDENT or part not in self.collectors:
            return 0
        return sum(m.nbytes for m in self._collect(part))

    @torch.no_grad()
    def stage(self, parts: Sequence[str]) -> MoveStats:
        """Copy `parts` (those resident and kept, not dropped) to host memory ahead of their offload, leaving them
        resident: on a GPU the copies are queued on the offload's stream after the work queued so far, and this
        returns at once (see the module docstring)."""
        start = time.perf_counter()
        stats = MoveStats()
        todo = [p for p in _checked(parts) if self.states[p] is PartState.RESIDENT and p in self.collectors
                and p not in DROPPED_PARTS and p not in self._staged]
        moved = {p: self._collect(p) for p in todo}
        copied = self._to_host(moved, self._copy_stream_after_compute() if _any_cuda(moved) else None)
        for part, ms in moved.items():
            self._staged[part] = (ms, copied)
            stats.bytes[part] = sum(m.nbytes for m in ms)
        stats.seconds = time.perf_counter() - start
        return stats

    def drop_staged(self, parts: Sequence[str] = OFFLOAD_PARTS) -> None:
        """Forget what `stage` copied of `parts` (they are about to be written, or no offload will take the copies).
        Work queued on the compute stream from now on runs after those copies: a write must not overtake them."""
        for part in _checked(parts):
            staged = self._staged.pop(part, None)
            if staged is not None and staged[1] is not None:
                torch.cuda.current_stream().wait_event(staged[1])

    def staged_copies(self) -> Callable[[Tensor], tuple[Tensor, Any] | None]:
        """What `stage` copied, looked up by tensor: for a tensor over a staged storage, the same view (offset,
        shape, strides) of that storage's host copy and the event the copy lands after (None: landed); None for a
        tensor whose storage is not staged. A checkpoint taken between the stage and the offload writes these
        instead of copying the same bytes again (the host memory stays alive while it holds them)."""
        index = {m.storage.data_ptr(): (m.host, copied)
                 for moved, copied in self._staged.values() for m in moved if m.host is not None}

        def lookup(t: Tensor) -> tuple[Tensor, Any] | None:
            storage = t.untyped_storage()
            found = index.get(storage.data_ptr()) if storage.nbytes() > 0 else None
            if found is None:
                return None
            host, copied = found
            view = torch.empty(0, dtype=t.dtype).set_(host.untyped_storage(), t.storage_offset(), t.shape, t.stride())
            return view, copied

        return lookup

    def _take_staged(self, part: str, collected: list[_Moved]) -> tuple[list[_Moved], Any] | None:
        """What `stage` copied of `part`, if its storages are still the ones collected now (and once)."""
        staged = self._staged.pop(part, None)
        if staged is None or _keys(staged[0]) != _keys(collected):
            return None
        return staged

    def _to_host(self, moved: dict[str, list[_Moved]], stream: Any) -> Any:
        """Host buffers for `moved` (all made before any copy is queued: a new pinned block may wait for the
        device), then their copies, on `stream` when given; the event after them (None: they are done)."""
        for m in (m for ms in moved.values() for m in ms):
            m.host = torch.empty(m.nbytes, dtype=torch.uint8, pin_memory=self.pin and m.device.type == "cuda")
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for m in (m for ms in moved.values() for m in ms):
                m.host.untyped_storage().copy_(m.storage, non_blocking=True)
        return _record(stream)

    @torch.no_grad()
    def offload(self, parts: Sequence[str], wait: bool = True, keep_free: int = 0) -> MoveStats:
        """Move `parts` (those resident) to host memory, freeing their device storage. `wait=False`: leave the
        copies of the kept parts in flight, those parts LEAVING until `settle`, if the device keeps `keep_free`
        bytes free once the dropped parts are gone (else, and for the dropped parts, as with `wait=True`)."""
        start = time.perf_counter()
        stats = MoveStats(deferred=None if wait else False)
        parts = _checked(parts)
        self.settle(parts)  # a part still leaving is gone once settled: offloading it again is a no-op
        self.require_resident([p for p in parts if self.states[p] is PartState.RESIDENT], "an offload")
        todo = [p for p in parts if self.states[p] is PartState.RESIDENT and p in self.collectors]
        # Dropped parts go first and at once: their wait for kernels still reading them would otherwise wait for
        # the copies queued before it too.
        dropped = {p: self._collect(p) for p in todo if p in DROPPED_PARTS}
        _synchronize([m for ms in dropped.values() for m in ms])
        for part, moved in dropped.items():
            self._gone(part, moved)
            stats.bytes[part] = sum(m.nbytes for m in moved)
        # Whether device memory was freed and not yet handed back to the driver (`empty_cache`).
        hand_back = _any_cuda(dropped)
        kept = {p: self._collect(p) for p in todo if p not in DROPPED_PARTS}
        if not wait and hand_back:
            torch.cuda.empty_cache()  # before the room is measured, and where the engines can take it
            hand_back = False
        leave = not wait and _room(kept, keep_free)
        # Parts `stage` copied already: their copies and the event after them; the others are copied now.
        done = {p: ahead for p, ms in kept.items() if (ahead := self._take_staged(p, ms)) is not None}
        fresh = {p: ms for p, ms in kept.items() if p not in done}
        copies = self._to_host(fresh, self._copy_stream_after_compute() if leave and _any_cuda(fresh) else None)
        for part, moved in kept.items():
            moved, copied = done.get(part, (moved, copies))
            stats.bytes[part] = sum(m.nbytes for m in moved)
            self._moved[part] = moved
            if leave:
                self.states[part] = PartState.LEAVING
                self._leaving[part] = copied
                stats.deferred = True
        if not leave:
            _synchronize([m for ms in kept.values() for m in ms])  # the copies land before the storages go
            for part in kept:
                self._gone(part, self._moved[part])
            hand_back = hand_back or _any_cuda(kept)
        if hand_back:
            torch.cuda.empty_cache()  # hand the freed blocks back to the driver, where the engines can take them
        stats.seconds = time.perf_counter() - start
        return stats

    def _gone(self, part: str, moved: list[_Moved]) -> None:
        """`part`'s storages freed (their bytes on the host or dropped): OFFLOADED."""
        for m in moved:
            m.storage.resize_(0)
        self._moved[part] = moved
        self.states[part] = PartState.OFFLOADED

    def settle(self, parts: Sequence[str] = OFFLOAD_PARTS) -> float:
        """Finish the offload of `parts` still LEAVING: wait for their copies, free their storages and hand the
        memory to the driver (a no-op for the others); the seconds spent."""
        start = time.perf_counter()
        leaving = {p: self._moved[p] for p in _checked(parts) if self.states[p] is PartState.LEAVING}
        for part, moved in leaving.items():
            if (event := self._leaving.pop(part)) is not None:
                event.synchronize()
            self._gone(part, moved)
        if _any_cuda(leaving):
            torch.cuda.empty_cache()
        return time.perf_counter() - start

    def _copy_stream_after_compute(self) -> Any:
        """The offload's own stream, after the work already queued on the compute stream."""
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream()
        self._copy_stream.wait_stream(torch.cuda.current_stream())
        return self._copy_stream

    @torch.no_grad()
    def onload(self, parts: Sequence[str] = OFFLOAD_PARTS) -> MoveStats:
        """Bring `parts` (those offloaded) back into their storages, bit for bit; on a GPU the copies run on the
        offload's own stream and this returns once they are queued (see the module docstring)."""
        start = time.perf_counter()
        stats = MoveStats()
        self.settle(parts)
        for part in _checked(parts):
            if self.states[part] is PartState.RESIDENT:
                continue
            moved = self._moved[part]
            on_gpu = any(m.device.type == "cuda" for m in moved)
            for m in moved:
                m.storage.resize_(m.nbytes)  # allocated on the compute stream, which will use it
                if m.host is None:
                    _zero(m.storage, m.device)
            if on_gpu:
                self._pending[part] = self._copy_in(moved)
            else:
                for m in moved:
                    if m.host is not None:
                        m.storage.copy_(m.host.untyped_storage())
            nbytes = sum(m.nbytes for m in moved)
            self._moved[part] = []
            self.states[part] = PartState.RESIDENT
            stats.bytes[part] = nbytes
        stats.seconds = time.perf_counter() - start
        return stats

    def _copy_in(self, moved: Sequence[_Moved]) -> Any:
        """Queue the host-to-device copies of `moved` on the offload's stream, after the work already queued on
        the compute stream (the storages' new allocations); the event marking their end."""
        stream = self._copy_stream_after_compute()
        with torch.cuda.stream(stream):
            for m in moved:
                if m.host is not None:
                    m.storage.copy_(m.host.untyped_storage(), non_blocking=True)
        return _record(stream)

    def resident_bytes(self) -> int:
        """Bytes of the trainer's parts held in compute memory now (what an engine cannot use)."""
        self.settle()
        seen: dict[int, int] = {}
        for part, collect in self.collectors.items():
            if self.states[part] is PartState.RESIDENT:
                seen.update({k: s.nbytes() for k, (s, _) in _storages(collect()).items()})
        return sum(seen.values())


def _checked(parts: Sequence[str]) -> list[str]:
    unknown = [p for p in parts if p not in OFFLOAD_PARTS]
    if unknown:
        raise ValueError(f"unknown trainer parts {unknown}; known: {OFFLOAD_PARTS}")
    return list(dict.fromkeys(parts))


def _zero(storage: torch.UntypedStorage, device: torch.device) -> None:
    """Fill a storage with zero bytes (a dropped part comes back as the zeros a new step would start from)."""
    torch.empty(0, dtype=torch.uint8, device=device).set_(storage).zero_()


def _keys(moved: Sequence[_Moved]) -> list[tuple[int, int]]:
    """What identifies the storages of `moved`: their addresses and sizes."""
    return [(m.storage.data_ptr(), m.nbytes) for m in moved]


def _synchronize(moved: Sequence[_Moved]) -> None:
    if any(m.device.type == "cuda" for m in moved):
        torch.cuda.synchronize()


def _any_cuda(moved: dict[str, list[_Moved]]) -> bool:
    return any(m.device.type == "cuda" for ms in moved.values() for m in ms)


def _record(stream: Any) -> Any:
    """An event after the work queued on `stream` so far (None without a stream: the copies are done)."""
    if stream is None:
        return None
    done = torch.cuda.Event()
    done.record(stream)
    return done


def _room(moved: dict[str, list[_Moved]], keep_free: int) -> bool:
    """Whether the device of `moved` has `keep_free` bytes free now (host memory always has the room: the
    storages stay where they are)."""
    device = next((m.device for ms in moved.values() for m in ms if m.device.type == "cuda"), None)
    return device is None or torch.cuda.mem_get_info(device)[0] >= keep_free


def actor_offload(actor: Any) -> TrainerOffload:
    """The offload of a `TrainerActor`: its model (with LoRA adapters, which live beside the frozen base in
    their own module), Megatron DDP buffers, optimizer and update guard."""
    model = actor.policy.model
    buffers = getattr(actor.ddp, "buffers", [])

    def weights() -> list[Tensor]:
        # Adapters are parameters too: left out, their fp32 tensors (the optimizer's own on a CPU) would move
        # under "optimizer" and be gone while a push reads them.
        return [*model.parameters(), *(actor.lora.parameters() if actor.lora is not None else ())]

    def params() -> list[Tensor | None]:
        return [*weights(), *(getattr(b, "param_data", None) for b in buffers)]

    def grads() -> list[Tensor | None]:
        every = [*buffers, *getattr(actor.ddp, "expert_parallel_buffers", [])]
        return [*(b.grad_data for b in every), *(p.grad for p in weights())]

    def optimizer() -> list[Tensor]:
        return optimizer_tensors(actor.optimizer, weights(), actor.guard)

    return TrainerOffload({"params": params, "grads": grads, "optimizer": optimizer})


def device_memory(offload: TrainerOffload, device: torch.device, parts: bool) -> dict[str, float]:
    """The device's free and total bytes (`free_bytes`, `total_bytes`; nothing on a CPU, which has no device memory
    to share); with `parts`, after the trainer's cached blocks go back to the driver, also `<part>_bytes` of each
    part a checkpoint holds (`KEPT_PARTS`) resident now."""
    if device.type != "cuda":
        return {}
    if parts:
        torch.cuda.empty_cache()  # free memory the caching allocator holds is the engines' to take
    free, total = torch.cuda.mem_get_info(device)
    out = {"free_bytes": float(free), "total_bytes": float(total)}
    return {**out, **{f"{p}_bytes": float(offload.part_bytes(p)) for p in KEPT_PARTS}} if parts else out


def memory_stats(offload: TrainerOffload, device: torch.device, reset_peak: bool) -> dict[str, float]:
    """Bytes of trainer state resident in compute memory; on a GPU also this process's peak allocation since
    the last reset and the device memory in use (every process's: the engines' too)."""
    out = {"trainer_state_bytes": float(offload.resident_bytes())}
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        out.update(trainer_peak_bytes=float(torch.cuda.max_memory_allocated(device)),
                   device_used_bytes=float(total - free))
        if reset_peak:
            torch.cuda.reset_peak_memory_stats(device)
    return out


def optimizer_tensors(optimizer: object, model_params: Iterable[Tensor], guard: object | None) -> list[Tensor]:
    """The optimizer part of a Megatron optimizer (a `ChainedOptimizer` or one leaf): main parameters that are
    not model parameters, their state tensors, and the divergence guard's snapshot (`guard`, if any)."""
    model = {id(p) for p in model_params}
    out: list[Tensor] = []
    for leaf in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        inner = getattr(leaf, "optimizer", None)
        if inner is None:
            continue
        for group in inner.param_groups:
            out += [p for p in group["params"] if id(p) not in model]
        for state in inner.state.values():
            out += [v for v in state.values() if isinstance(v, Tensor)]
    if guard is not None:
        out += list(getattr(guard, "_saved_params", []))
        for _, saved in getattr(guard, "_state", []):
            out += [v for v in saved.values() if isinstance(v, Tensor)]
    return out
