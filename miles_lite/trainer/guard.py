"""Step guards: an optimizer step that would leave diverged weights is undone before anyone sees them.

The non-finite guard (in `actor.py`) catches NaN/Inf losses and gradients before the step. A finite
but exploding step (a learning rate off by orders of magnitude) passes it and is only visible after
the update: `UpdateGuard` snapshots the optimizer's parameters and state before the step, measures
the update-to-weight ratio ||w' - w|| / ||w|| over all ranks after it, and restores the snapshot when
the ratio exceeds `trainer.max_update_ratio`. Restored weights are exactly the ones before the step,
so nothing diverged is ever pushed to the engines or checkpointed.

Cost: one device copy of the optimizer's parameters and state (for Adam in fp32, three times the
parameter bytes) and two norms per step; `trainer.max_update_ratio=0` turns it off.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor


class TrainingHalted(RuntimeError):
    """The trainer refuses to go on; the weights it holds are the last good ones (safe to checkpoint)."""


class NonFiniteStepError(TrainingHalted):
    """Too many consecutive optimizer steps had a non-finite loss or gradient."""


class DivergedStepError(TrainingHalted):
    """Too many consecutive optimizer steps moved the weights by more than `trainer.max_update_ratio`."""


def _leaves(optimizer: Any) -> list[Any]:
    """The Megatron optimizers that own a torch optimizer (a ChainedOptimizer holds several)."""
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


class UpdateGuard:
    """Snapshot before an optimizer step; measure and, when too large, undo it after.

    Args:
        optimizer: the Megatron optimizer (its torch optimizer's params are the main params: the
            model's own in fp32, fp32 copies with bf16 weights).
        max_ratio: largest ||update|| / ||weights|| a step may make (> 0).
    """

    def __init__(self, optimizer: Any, max_ratio: float) -> None:
        self.optimizer = optimizer
        self.max_ratio = max_ratio
        self._params: list[Tensor] = []
        self._state: list[tuple[dict[str, Any], dict[str, Any]]] = []  # (live state, saved copy)
        self._saved_params: list[Tensor] = []
        self._fresh: list[tuple[Any, Tensor]] = []  # params without optimizer state before the step

    def _torch_optimizers(self) -> list[torch.optim.Optimizer]:
        return [leaf.optimizer for leaf in _leaves(self.optimizer) if getattr(leaf, "optimizer", None) is not None]

    @torch.no_grad()
    def snapshot(self) -> None:
        """Copy every main parameter and its optimizer state (reusing the buffers of the last snapshot)."""
        params = [p for opt in self._torch_optimizers() for g in opt.param_groups for p in g["params"]]
        if len(params) != len(self._saved_params) or any(
                a.shape != b.shape or a.dtype != b.dtype for a, b in zip(params, self._saved_params, strict=True)):
            self._saved_params = [torch.empty_like(p) for p in params]
        for buf, p in zip(self._saved_params, params, strict=True):
            buf.copy_(p.detach())
        self._params = params
        self._state, self._fresh = [], []
        for opt in self._torch_optimizers():
            for g in opt.param_groups:
                for p in g["params"]:
                    live = opt.state.get(p)
                    if not live:
                        self._fresh.append((opt, p))
                        continue
                    saved = {k: v.detach().clone() if isinstance(v, Tensor) else v for k, v in live.items()}
                    self._state.append((live, saved))

    @torch.no_grad()
    def update_ratio(self) -> float:
        """||w' - w|| / ||w|| of the step since `snapshot`, summed over every rank's shards."""
        device = self._params[0].device if self._params else torch.device("cpu")
        sums = torch.zeros(2, dtype=torch.float64, device=device)
        for p, old in zip(self._params, self._saved_params, strict=True):
            sums[0] += (p.detach().double() - old.double()).square().sum()
            sums[1] += old.double().square().sum()
        if dist.is_initialized():
            dist.all_reduce(sums)
        delta, weight = (float(x) for x in sums.sqrt().tolist())
        return delta / weight if weight > 0 else (0.0 if delta == 0 else float("inf"))

    @torch.no_grad()
    def restore(self) -> None:
        """Put back the parameters and optimizer state of the snapshot (and the model copies of the weights)."""
        for p, old in zip(self._params, self._saved_params, strict=True):
            p.copy_(old)
        for live, saved in self._state:
            for k, v in saved.items():
                if isinstance(v, Tensor) and isinstance(live.get(k), Tensor):
                    live[k].copy_(v)
                else:
                    live[k] = v.clone() if isinstance(v, Tensor) else v
        for opt, p in self._fresh:
            opt.state.pop(p, None)
        for leaf in _leaves(self.optimizer):
            # Mixed precision: the model's bf16 weights are copies of the fp32 main params just restored.
            copy = getattr(leaf, "_copy_main_params_to_model_params", None)
            if copy is not None:
                copy()
