"""Import megatron-core without compiling kernels a CPU run never calls.

megatron-core decorates its fused kernels (bias-GeLU, bias-dropout-add, SwiGLU, ...) with `jit_fuser`, which
is `torch.compile` on torch >= 2.2: decorating imports TorchDynamo and Inductor, about 2 s of CPU at every
start of a trainer process. A CPU run turns those fusions off (`trainer/model.py`: bias_activation_fusion,
bias_dropout_fusion and masked_softmax_fusion follow the device), so the decorated functions never run; on a
CPU-only torch they are left undecorated (megatron's own `disable_jit_fuser`) and Dynamo is not imported.
With CUDA nothing changes. `arm()` (the trainer package's import) routes the process's import of
`megatron.core` through here, so the trainer's modules keep importing megatron where they use it and a
process that never does pays nothing.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Sequence
from typing import Any


def _undecorated(model: Callable[..., Any] | None = None, **_options: Any) -> Any:
    """`torch.compile`'s shape as a decorator, returning the function itself."""
    return model if model is not None else (lambda fn: fn)


class _CoreLoader(importlib.abc.Loader):
    """Executes `megatron.core` (whose own imports decorate the fused kernels) with `torch.compile` swapped
    for `_undecorated` when no CUDA device is usable, then turns megatron's `jit_fuser` off."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self.loader = loader

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        import torch

        if torch.cuda.is_available():
            self.loader.exec_module(module)
            return
        compile_fn = torch.compile
        torch.compile = _undecorated  # type: ignore[assignment]
        try:
            self.loader.exec_module(module)
            sys.modules["megatron.core.jit"].disable_jit_fuser()  # modules imported later decorate with its no-op
        finally:
            torch.compile = compile_fn  # type: ignore[assignment]


class _FirstImport(importlib.abc.MetaPathFinder):
    """Finds `megatron.core` with the regular finders and hands it `_CoreLoader`, once."""

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: Any = None) -> Any:
        if fullname != "megatron.core":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _CoreLoader(spec.loader)
        return spec


def arm() -> None:
    """Route the process's import of `megatron.core` through `_CoreLoader` (idempotent; nothing once imported)."""
    if "megatron.core" not in sys.modules and not any(isinstance(f, _FirstImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _FirstImport())
