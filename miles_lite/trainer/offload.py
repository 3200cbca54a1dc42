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

Each part is RESIDENT or OFFLOADED; offloading an offloaded part or onloading a resident one is a no-op, so
the driver may ask for "everything resident" without tracking what was moved.

On a GPU an onload does not wait for its copies: they run on a stream of their own, and whatever reads a part
waits for that part's copies first: `require_resident` (log-probs, the weight push, checkpoints) on the host,
`ready_on_device` (the optimizer step) on the device only, so the optimizer state comes back while the step's
forward and backward run on the parameters that came back first.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from miles_lite.config.offload import OFFLOAD_PARTS


class PartState(enum.Enum):
    RESIDENT = "resident"
    OFFLOADED = "offloaded"


# Parts whose values no one reads across a hand-off: their storage is freed, not copied, and comes back zeroed.
DROPPED_PARTS = frozenset({"grads"})


@dataclass
class _Moved:
    """One storage while it is offloaded: the storage object itself and its bytes on the host (None: dropped)."""

    storage: torch.UntypedStorage
    host: Tensor | None
    device: torch.device
    nbytes: int


@dataclass
class MoveStats:
    """What one offload or onload moved: bytes per part and wall seconds."""

    bytes: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0


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
        self._copy_stream: Any = None

    def offloaded(self) -> frozenset[str]:
        return frozenset(p for p, s in self.states.items() if s is PartState.OFFLOADED)

    def require_resident(self, parts: Sequence[str], what: str) -> None:
        """Raise naming the offloaded `parts` that `what` needs on the device; wait (on the host) for the copies
        of an onload of them still in flight."""
        self.check_resident(parts, what)
        for part in parts:
            if (event := self._pending.pop(part, None)) is not None:
                event.synchronize()

    def check_resident(self, parts: Sequence[str], what: str) -> None:
        """Raise naming the offloaded `parts` that `what` needs on the device."""
        away = [p for p in parts if self.states[p] is PartState.OFFLOADED]
        if away:
            raise RuntimeError(f"{what} needs the trainer's {', '.join(away)} on the device, and they are offloaded "
                               "to host memory; onload them first")

    def ready_on_device(self, parts: Sequence[str], what: str) -> None:
        """Like `require_resident`, but the wait for copies in flight is the device's: work queued after this
        call runs after them, and the host goes on at once."""
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

    @torch.no_grad()
    def offload(self, parts: Sequence[str]) -> MoveStats:
        """Move `parts` (those resident) to host memory, freeing their device storage."""
        start = time.perf_counter()
        stats = MoveStats()
        self.require_resident([p for p in _checked(parts) if self.states[p] is PartState.RESIDENT], "an offload")
        for part in _checked(parts):
            if self.states[part] is PartState.OFFLOADED or part not in self.collectors:
                continue
            skip = self._claimed_elsewhere(part)
            moved, nbytes = [], 0
            for key, (storage, device) in _storages(self.collectors[part]()).items():
                if key in skip:
                    continue
                host = None
                if part not in DROPPED_PARTS:
                    host = torch.empty(storage.nbytes(), dtype=torch.uint8,
                                       pin_memory=self.pin and device.type == "cuda")
                    host.untyped_storage().copy_(storage, non_blocking=True)
                moved.append(_Moved(storage, host, device, storage.nbytes()))
                nbytes += storage.nbytes()
            _synchronize(moved)  # the copies (and any kernel still reading a dropped part) land before it goes
            for m in moved:
                m.storage.resize_(0)
            self._moved[part] = moved
            self.states[part] = PartState.OFFLOADED
            stats.bytes[part] = nbytes
        if any(m.device.type == "cuda" for ms in self._moved.values() for m in ms):
            torch.cuda.empty_cache()  # hand the freed blocks back to the driver, where the engines can take them
        stats.seconds = time.perf_counter() - start
        return stats

    @torch.no_grad()
    def onload(self, parts: Sequence[str] = OFFLOAD_PARTS) -> MoveStats:
        """Bring `parts` (those offloaded) back into their storages, bit for bit; on a GPU the copies run on the
        offload's own stream and this returns once they are queued (see the module docstring)."""
        start = time.perf_counter()
        stats = MoveStats()
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
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream()
        self._copy_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._copy_stream):
            for m in moved:
                if m.host is not None:
                    m.storage.copy_(m.host.untyped_storage(), non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._copy_stream)
        return done

    def resident_bytes(self) -> int:
        """Bytes of the trainer's parts held in compute memory now (what an engine cannot use)."""
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


def _synchronize(moved: Sequence[_Moved]) -> None:
    if any(m.device.type == "cuda" for m in moved):
        torch.cuda.synchronize()


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
