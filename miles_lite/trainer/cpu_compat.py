"""The few shims megatron-core 0.16 needs to run on a CPU-only torch build, in one place.

megatron-core assumes CUDA in a handful of spots that have nothing to do with the math: a device
query used as a `device=` argument, stream synchronisation, the model-parallel RNG tracker and
about thirty hard-coded `device="cuda"` tensors in the optimizer, grad clipping and pipeline
schedules, and the fused optimizer kernels it takes from TransformerEngine whenever that imports. Each
shim below replaces exactly one of those assumptions. Nothing here is applied when CUDA is available:
`cpu_mode_needed()` gates every entry point.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from megatron.core.tensor_parallel import random as mrand
from torch.overrides import TorchFunctionMode


def cpu_mode_needed() -> bool:
    """True when this process must run megatron-core on CPU (no usable CUDA device)."""
    return not torch.cuda.is_available()


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    # A bare int is a CUDA ordinal for torch's factory functions.
    return isinstance(device, int) and not isinstance(device, bool)


# Tensor methods that place or name a tensor's device without a `device=` keyword.
_PLACING = frozenset({torch.Tensor.cuda, torch.Tensor.type, torch.Tensor.to})


class CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA placements to CPU for the torch calls made while the mode is active.

    Why: megatron's optimizer (`_scale = torch.tensor(..., device='cuda')`), grad clipping and the
    schedules create small bookkeeping tensors on 'cuda'; on a CPU build they must live on CPU.
    `Tensor.type()` answers with the `torch.cuda.*` name because clip_grads and the distributed
    optimizer assert that parameters are CUDA tensors by their type string.
    Torch function modes are per thread: code running in other threads is not covered.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch protocol
        # Every torch call of a train step passes here: the few that can name a device go the long way.
        if func not in _PLACING and (not kwargs or ("device" not in kwargs and "pin_memory" not in kwargs)):
            return func(*args, **(kwargs or {}))
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if kwargs.get("pin_memory"):
            # Pinned host memory needs a CUDA driver.
            kwargs["pin_memory"] = False
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


class _CpuRNGStatesTracker(mrand.CudaRNGStatesTracker):
    """Megatron's named RNG streams, kept as CPU generator states.

    Why: `DotProductAttention.forward` always enters `get_cuda_rng_tracker().fork()` (even with
    dropout 0), and the stock tracker stores CUDA generator states, which a CPU build cannot create.
    """

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_:
            raise ValueError(f"seed {seed} already exists in the RNG tracker")
        if name in self.states_:
            raise ValueError(f"RNG state {name} already exists")
        self.seeds_.add(seed)
        saved = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(saved)

    @contextlib.contextmanager
    def fork(self, name: str = mrand._MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
        if name not in self.states_:
            raise KeyError(f"RNG state {name} was never added to the tracker")
        saved = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(saved)


def _no_sync(*_args: Any, **_kwargs: Any) -> None:
    """CPU work is synchronous; there is no stream to wait for."""


def _cpu_current_device() -> torch.device:
    return torch.device("cpu")


def patch_cuda_queries() -> None:
    """Answer megatron's `torch.cuda.current_device()` / `synchronize()` on a CPU build (idempotent).

    Why: ~30 call sites pass `device=torch.cuda.current_device()` (e.g. the global memory buffer
    used by attention), and the checkpoint writer calls `torch.cuda.synchronize()`; both raise
    "Torch not compiled with CUDA enabled" otherwise.
    """
    if not cpu_mode_needed():
        return
    torch.cuda.current_device = _cpu_current_device
    torch.cuda.synchronize = _no_sync


def use_torch_optimizer_kernels() -> None:
    """On CPU, megatron's optimizer runs torch's AdamW and megatron's own multi-tensor loops (idempotent).

    Why: megatron-core picks TransformerEngine's (or apex's) FusedAdam and multi-tensor kernels whenever
    that package imports, as in the GPU image, and they run on CUDA tensors only: a CPU run there failed
    at its first gradient norm. The torch and local versions are the ones megatron falls back to itself
    when neither is installed.
    """
    if not cpu_mode_needed():
        return
    import importlib

    from megatron.core import utils

    package = importlib.import_module("megatron.core.optimizer")
    if getattr(package, "USING_PYTORCH_OPTIMIZER", True) is False:
        package.Adam, package.SGD, package.USING_PYTORCH_OPTIMIZER = torch.optim.AdamW, torch.optim.SGD, True
    local = {"multi_tensor_applier": utils.local_multi_tensor_applier,
             "multi_tensor_scale_impl": utils.local_multi_tensor_scale,
             "l2_norm_impl": utils.local_multi_tensor_l2_norm}
    for name in ("megatron.core.optimizer.clip_grads", "megatron.core.optimizer.optimizer"):
        module = importlib.import_module(name)
        for attr, impl in local.items():
            if hasattr(module, attr):
                setattr(module, attr, impl)


def use_torch_moe_kernels() -> None:
    """On CPU, megatron's MoE router computes its logits with torch instead of TransformerEngine (idempotent).

    Why: `moe_utils` calls `te_general_gemm` whenever it is not None, but it only binds the name when
    TransformerEngine imports: without TE the router fails with NameError, and with TE (the GPU image)
    the kernel needs CUDA tensors. None is the value megatron's own fallback branch tests for.
    """
    if not cpu_mode_needed():
        return
    from megatron.core.transformer.moe import moe_utils

    moe_utils.te_general_gemm = None


def install_rng_tracker(seed: int, tp_rank: int, ep_rank: int = 0, etp_rank: int = 0) -> None:
    """Install the CPU RNG tracker seeded like `model_parallel_cuda_manual_seed`.

    Seeds: data-parallel stream = seed, tensor-parallel stream = seed + 2718 + tp_rank, expert
    stream = seed + 1024 + 100 * ep_rank + etp_rank, so CPU runs draw what GPU runs would.
    """
    tracker = _CpuRNGStatesTracker()
    torch.manual_seed(seed)
    tracker.add(mrand._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(mrand._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
    tracker.add(mrand._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024 + 100 * ep_rank + etp_rank)
    mrand._CUDA_RNG_STATE_TRACKER = tracker
    mrand._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


def use_cpu_rng_state() -> None:
    """On CPU, megatron's device RNG state is the CPU generator's (idempotent).

    Why: activation recompute (`trainer.transformer.recompute_granularity`) saves the CUDA generator's state
    beside the CPU one and restores both before recomputing, which raises "Torch not compiled with CUDA
    enabled" on a CPU build.
    """
    if not cpu_mode_needed():
        return
    mrand._get_cuda_rng_state = _cpu_rng_state
    mrand._set_cuda_rng_state = _set_cpu_rng_state


def _cpu_rng_state(*_args: Any, **_kwargs: Any) -> torch.Tensor:
    return torch.get_rng_state()


def _set_cpu_rng_state(state: torch.Tensor, *_args: Any, **_kwargs: Any) -> None:
    torch.set_rng_state(state)


def seed_model_parallel(seed: int, tp_rank: int) -> None:
    """Seed torch and megatron's model-parallel RNG streams on CPU or GPU."""
    if cpu_mode_needed():
        install_rng_tracker(seed, tp_rank)
        use_cpu_rng_state()
    else:
        mrand.model_parallel_cuda_manual_seed(seed)


def device_mode() -> contextlib.AbstractContextManager[Any]:
    """Context that maps CUDA placements to CPU on a CPU build, and does nothing on a GPU build."""
    return CudaToCpuMode() if cpu_mode_needed() else contextlib.nullcontext()


def compute_mode() -> contextlib.AbstractContextManager[Any]:
    """The context of forward and backward passes: nothing. They place no tensor on 'cuda' on a CPU build (the
    device queries they make are answered by `patch_cuda_queries`; the RNG by the CPU tracker), so they run
    without `CudaToCpuMode`, whose Python hook on every torch call costs 10-20% of a small model's step;
    the optimizer, gradient finalisation and checkpoints, which do place tensors, keep `device_mode`."""
    return contextlib.nullcontext()
