"""Step guards: an optimizer step that would leave diverged weights is undone before anyone sees them.

The non-finite guard (in `actor.py`, reading gradients through `all_finite`) catches NaN/Inf losses and
gradients before the step. A finite but exploding step (a learning rate off by orders of magnitude)
passes it and is only visible after the update: `UpdateGuard` keeps every step's update-to-weight
ratio ||w' - w|| / ||w|| (over all ranks) within `trainer.max_update_ratio`, undoing a step that
exceeds it. Restored weights and optimizer state are exactly the ones before the step, so nothing
diverged is ever pushed to the engines or checkpointed.

What it costs, per step:

- Before the step, a bound on the step's size, from host numbers alone on most steps: the norm of each
  parameter group's main parameters is measured (`torch._foreach_norm`, one all-reduce, one host sync) every
  `EXACT_NORM_EVERY` steps, and in between carried forward through the guard's own bounds on each step's
  update (||w'|| lies within ||w|| -+ ||w' - w||), until the carried range is `CARRY_SLACK` wide. Adam's
  update of one element, m_hat / (sqrt(v_hat) + eps), is bounded
  whatever the gradients were: by Cauchy-Schwarz over the moving averages,
  |m_t| <= (1 - b1) * sqrt(sum_{j<t} (b1^2 / b2)^j) * sqrt(v_t / (1 - b2)), so with bias correction
  |m_hat / sqrt(v_hat)| <= (1 - b1) / (1 - b1^t) * sqrt((1 - b2^t) / (1 - b2)) * sqrt(sum_{j<t} (b1^2/b2)^j).
  Hence ||w' - w|| <= lr * (B_t * sqrt(numel) + weight_decay * ||w||) per parameter group (the norms taken
  over every rank's shards), and over the groups at most the sum of theirs. With the learning rates training
  uses this is far below the limit: the step cannot diverge, and it runs as is.
- Only when the bound does not rule the limit out (a learning rate far too large, a tiny limit, an
  optimizer that is not Adam in fp32): a snapshot of the main parameters, their optimizer state and the
  param groups' counters, taken before the step, in host memory for parameters on a GPU (pinned, reused),
  then the step's exact ratio, measured in fp32 chunk by chunk, and the undo from the snapshot when it
  exceeds the limit.

`trainer.max_update_ratio=0` turns the guard off.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

# Elements per chunk when the exact ratio is measured against a host snapshot (64 Mi fp32 = 256 MiB).
CHUNK_ELEMENTS = 1 << 26
# Relative slack on the bound for fp32 rounding of the norms and of the optimizer's own arithmetic.
BOUND_SLACK = 1e-3
# Steps between measurements of the main parameters' norms (a host sync each); in between they are carried.
EXACT_NORM_EVERY = 50
# How wide the carried range of the weights' norm may grow (upper / lower - 1) before it is measured again.
CARRY_SLACK = 1e-2


class TrainingHalted(RuntimeError):
    """The trainer refuses to go on; the weights it holds are the last good ones (safe to checkpoint)."""


class NonFiniteStepError(TrainingHalted):
    """Too many consecutive optimizer steps had a non-finite loss or gradient."""


class DivergedStepError(TrainingHalted):
    """Too many consecutive optimizer steps moved the weights by more than `trainer.max_update_ratio`."""


def all_finite(tensors: list[Tensor]) -> Tensor:
    """A device bool: no NaN or Inf in any of `tensors`, read with no host sync. Each tensor's min and max
    (NaN propagates through both, an Inf is one of them): two scalars a tensor, where `isfinite(t)` would
    make a temporary as large as `t` (28 GiB for a 7B model's fp32 gradient buffer, more than a full H200
    has left during the step)."""
    values = [v.float() for t in tensors if t.numel() for v in torch.aminmax(t)]
    return torch.isfinite(torch.stack(values)).all() if values else torch.tensor(True)


def _leaves(optimizer: Any) -> list[Any]:
    """The Megatron optimizers that own a torch optimizer (a ChainedOptimizer holds several)."""
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def adam_element_bound(beta1: float, beta2: float, step: int, bias_correction: bool = True) -> float:
    """Largest |m_hat / sqrt(v_hat)| Adam's step `step` (1-based) can make, whatever the gradients were."""
    if step < 1:
        raise ValueError(f"step must be >= 1, got {step}")
    if beta2 <= 0:  # v is the last squared gradient alone: m / sqrt(v) is unbounded unless m is that gradient
        return 1.0 if beta1 == 0 else math.inf
    ratio = beta1 * beta1 / beta2
    if ratio == 1.0:
        series = float(step)
    elif ratio > 1 and step * math.log(ratio) > 700:
        return math.inf
    else:
        series = (1 - ratio ** step) / (1 - ratio)
    bound = (1 - beta1) * math.sqrt(series) / math.sqrt(1 - beta2)
    if bias_correction:
        bound *= math.sqrt(1 - beta2 ** step) / (1 - beta1 ** step)
    return bound


def _is_adam(opt: torch.optim.Optimizer) -> bool:
    """Adam/AdamW whose moments are kept in fp32 next to the parameters it updates (torch's, or the fused
    Adam of TransformerEngine/apex without master weights or low-precision moments)."""
    if isinstance(opt, torch.optim.Adam | torch.optim.AdamW):
        return True
    if type(opt).__name__ != "FusedAdam" or getattr(opt, "master_weights", False):
        return False
    return all(getattr(opt, name, torch.float32) == torch.float32 for name in ("exp_avg_dtype", "exp_avg_sq_dtype"))


def _next_steps(opt: torch.optim.Optimizer, group: dict[str, Any]) -> set[int] | None:
    """The Adam step number(s) the coming `opt.step()` uses for `group`'s parameters."""
    if "step" in group:  # fused Adams count per group
        return {int(group["step"]) + 1}
    counts = [opt.state[p]["step"] for p in group["params"] if opt.state.get(p) and "step" in opt.state[p]]
    fresh = any(not opt.state.get(p) for p in group["params"])
    steps = {1} if fresh or not counts else set()
    if counts:
        tensors = [c for c in counts if isinstance(c, Tensor)]
        values = [int(c) for c in counts if not isinstance(c, Tensor)]
        if tensors:
            values += torch.stack([t.detach().reshape(()).float().cpu() for t in tensors]).int().tolist()
        steps |= {v + 1 for v in values}
    return steps


@dataclass(frozen=True)
class StepCheck:
    """What the guard found about one optimizer step."""

    bound: float  # upper bound of the ratio, known before the step (inf when none could be derived)
    ratio: float | None  # the exact ratio, measured only when the bound did not rule the limit out
    diverged: bool  # the step exceeded the limit (or is NaN): undo it with `restore()`


@dataclass
class _GroupNorms:
    """Each parameter group's main-parameter count and a range holding its norm, over every rank's shards:
    measured, then carried forward step by step through the bounds on each step's update."""

    layout: list[tuple[int, int]]  # (optimizer, parameter count) of each group: what the ranges describe
    numel: list[float]
    lower: list[float]
    upper: list[float]
    carried: int = 0  # steps since the measurement

    @staticmethod
    def measure(groups: list[tuple[torch.optim.Optimizer, dict[str, Any]]], layout: list[tuple[int, int]]
                ) -> _GroupNorms:
        """Each group's norm and element count, summed over ranks (one all-reduce, one host sync)."""
        params = [p.detach() for _, g in groups for p in g["params"]]
        device = params[0].device if params else torch.device("cpu")
        norms = torch._foreach_norm(params) if params else []
        sums = torch.zeros(2 * len(groups), dtype=torch.float64, device=device)  # ||w_g||^2..., numel_g...
        index = 0
        for i, (_, group) in enumerate(groups):
            count = len(group["params"])
            if count:
                sums[i] = torch.stack(norms[index:index + count]).double().square().sum()
                sums[len(groups) + i] = float(sum(p.numel() for p in group["params"]))
            index += count
        if dist.is_initialized():
            dist.all_reduce(sums)
        values = sums.tolist()
        weights = [math.sqrt(v) for v in values[:len(groups)]]
        return _GroupNorms(layout, values[len(groups):], list(weights), list(weights))

    def weight_lower(self) -> float:
        return math.sqrt(sum(w * w for w in self.lower))

    def carry(self, deltas: list[float]) -> None:
        """After a step each group's update stayed within `deltas`: so did the change of its norm."""
        self.lower = [max(0.0, w - d) for w, d in zip(self.lower, deltas, strict=True)]
        self.upper = [w + d for w, d in zip(self.upper, deltas, strict=True)]
        self.carried += 1

    def stale(self) -> bool:
        """Time to measure again: `EXACT_NORM_EVERY` steps carried, or the range grown `CARRY_SLACK` wide."""
        lower = self.weight_lower()
        upper = math.sqrt(sum(w * w for w in self.upper))
        return self.carried >= EXACT_NORM_EVERY or lower <= 0 or upper > lower * (1 + CARRY_SLACK)


class UpdateGuard:
    """Bound, and when needed snapshot, before an optimizer step; measure and undo it after.

    Args:
        optimizer: the Megatron optimizer (its torch optimizer's params are the main params: the
            model's own in fp32, fp32 copies with bf16 weights).
        max_ratio: largest ||update|| / ||weights|| a step may make (> 0).
        host_snapshot: keep snapshots in host memory (default: when the parameters are on a GPU).
    """

    def __init__(self, optimizer: Any, max_ratio: float, host_snapshot: bool | None = None) -> None:
        if not max_ratio > 0:
            raise ValueError(f"trainer.max_update_ratio={max_ratio} must be > 0 (0 turns the guard off)")
        self.optimizer = optimizer
        self.max_ratio = max_ratio
        self.host_snapshot = host_snapshot
        self.snapshots_taken = 0  # steps the bound could not clear (each took a snapshot)
        self._bound = math.inf
        self._weight = 0.0
        self._params: list[Tensor] = []
        self._saved_params: list[Tensor] = []
        # (live state, saved copy, device of each saved tensor)
        self._state: list[tuple[dict[str, Any], dict[str, Any], dict[str, torch.device]]] = []
        self._groups: list[tuple[dict[str, Any], dict[str, Any]]] = []  # (live group, saved scalars)
        self._fresh: list[tuple[Any, Tensor]] = []  # params without optimizer state before the step
        self._snapshot_live = False
        self._norms: _GroupNorms | None = None  # the main parameters' norms, measured or carried

    def _torch_optimizers(self) -> list[torch.optim.Optimizer]:
        return [leaf.optimizer for leaf in _leaves(self.optimizer) if getattr(leaf, "optimizer", None) is not None]

    def _main_params(self) -> list[Tensor]:
        return [p for opt in self._torch_optimizers() for g in opt.param_groups for p in g["params"]]

    # ---- before the step ----------------------------------------------------------------------------------

    @torch.no_grad()
    def prepare(self) -> float:
        """Bound the coming step; snapshot what an undo needs only if the bound does not rule the limit out.

        Returns the bound of the ratio (inf when none could be derived).
        """
        groups = [(opt, g) for opt in self._torch_optimizers() for g in opt.param_groups]
        layout = [(id(opt), len(g["params"])) for opt, g in groups]

        def bound_from(norms: _GroupNorms) -> tuple[_GroupNorms, list[float] | None, float]:
            deltas = self._deltas(groups, norms)
            return norms, deltas, self._ratio_bound(deltas, norms)

        carried = self._norms
        if carried is None or carried.layout != layout or carried.stale():
            norms, deltas, bound = bound_from(_GroupNorms.measure(groups, layout))
        else:
            norms, deltas, bound = bound_from(carried)
            if bound > self.max_ratio:  # a carried norm is a range: before a snapshot, the bound from measured ones
                norms, deltas, bound = bound_from(_GroupNorms.measure(groups, layout))
        self._bound, self._weight = bound, norms.weight_lower()
        if bound <= self.max_ratio:
            assert deltas is not None
            norms.carry(deltas)
            self._norms = norms
            self._release_snapshot()
        else:
            self._snapshot(self._main_params())
            self._norms = None  # the step is measured exactly and may be undone: measure the norms again after it
        return bound

    def invalidate(self) -> None:
        """The main parameters were written outside an optimizer step (a checkpoint restore): measure their norms
        again before the next step's bound."""
        self._norms = None

    def _deltas(self, groups: list[tuple[torch.optim.Optimizer, dict[str, Any]]],
                norms: _GroupNorms) -> list[float] | None:
        """Each group's bound on ||w' - w|| for the coming step (None when one cannot be derived)."""
        deltas: list[float] = []
        for (opt, group), numel, upper in zip(groups, norms.numel, norms.upper, strict=True):
            if not group["params"]:
                deltas.append(0.0)
                continue
            steps = _next_steps(opt, group) if _is_adam(opt) else None
            if steps is None or "betas" not in group:
                return None
            beta1, beta2 = (float(b) for b in group["betas"])
            per_element = max(adam_element_bound(beta1, beta2, s, bool(group.get("bias_correction", True)))
                              for s in steps)
            lr, decay = float(group["lr"]), float(group.get("weight_decay", 0.0))
            deltas.append(lr * (per_element * math.sqrt(numel) + decay * upper))
        return deltas

    @staticmethod
    def _ratio_bound(deltas: list[float] | None, norms: _GroupNorms) -> float:
        bound = sum(deltas) * (1 + BOUND_SLACK) if deltas is not None else math.inf
        weight = norms.weight_lower()
        return bound / weight if weight > 0 else (0.0 if bound == 0 else math.inf)

    def _on_host(self, params: list[Tensor]) -> bool:
        if self.host_snapshot is not None:
            return self.host_snapshot
        return bool(params) and params[0].device.type == "cuda"

    def _buffer_like(self, t: Tensor, host: bool) -> Tensor:
        if host and t.device.type != "cpu":
            return torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=torch.cuda.is_available())
        return torch.empty_like(t)

    def _snapshot(self, params: list[Tensor]) -> None:
        """Copy every main parameter, its optimizer state and the groups' counters (buffers reused)."""
        host = self._on_host(params)
        if len(params) != len(self._saved_params) or any(
                a.shape != b.shape or a.dtype != b.dtype for a, b in zip(params, self._saved_params, strict=True)):
            self._saved_params = [self._buffer_like(p, host) for p in params]
        for buf, p in zip(self._saved_params, params, strict=True):
            buf.copy_(p.detach(), non_blocking=True)
        previous = {id(live): saved for live, saved, _ in self._state}
        self._params = params
        self._state, self._fresh, self._groups = [], [], []
        for opt in self._torch_optimizers():
            for g in opt.param_groups:
                self._groups.append((g, {k: copy.deepcopy(v) for k, v in g.items() if k != "params"}))
                for p in g["params"]:
                    live = opt.state.get(p)
                    if not live:
                        self._fresh.append((opt, p))
                        continue
                    reusable = previous.get(id(live), {})
                    saved: dict[str, Any] = {}
                    devices: dict[str, torch.device] = {}
                    for k, v in live.items():
                        if isinstance(v, Tensor):
                            buf = reusable.get(k)
                            if not isinstance(buf, Tensor) or buf.shape != v.shape or buf.dtype != v.dtype:
                                buf = self._buffer_like(v, host)
                            saved[k], devices[k] = buf.copy_(v.detach(), non_blocking=True), v.device
                        else:
                            saved[k] = copy.deepcopy(v)
                    self._state.append((live, saved, devices))
        if host and params and params[0].device.type == "cuda":
            torch.cuda.current_stream(params[0].device).synchronize()  # the copies are complete before the step
        self._snapshot_live = True
        self.snapshots_taken += 1

    def _release_snapshot(self) -> None:
        self._snapshot_live = False

    # ---- after the step -----------------------------------------------------------------------------------

    @torch.no_grad()
    def check(self) -> StepCheck:
        """The step just taken: its bound, its exact ratio when a snapshot was needed, and whether to undo it."""
        if not self._snapshot_live:
            return StepCheck(self._bound, None, False)
        ratio = self._measured_ratio()
        return StepCheck(self._bound, ratio, not ratio <= self.max_ratio)  # NaN diverges too

    def _measured_ratio(self) -> float:
        """||w' - w|| / ||w|| since the snapshot, summed over every rank's shards (fp32, chunk by chunk)."""
        device = self._params[0].device if self._params else torch.device("cpu")
        delta_sq = torch.zeros((), dtype=torch.float32, device=device)
        for p, old in zip(self._params, self._saved_params, strict=True):
            live, saved = p.detach().reshape(-1), old.reshape(-1)
            for start in range(0, live.numel(), CHUNK_ELEMENTS):
                before = saved[start:start + CHUNK_ELEMENTS].to(device, non_blocking=True)
                delta_sq += torch.linalg.vector_norm(live[start:start + CHUNK_ELEMENTS] - before,
                                                     dtype=torch.float32).square()
        if dist.is_initialized():
            dist.all_reduce(delta_sq)
        delta = math.sqrt(float(delta_sq))
        return delta / self._weight if self._weight > 0 else (0.0 if delta == 0 else math.inf)

    @torch.no_grad()
    def restore(self) -> None:
        """Put back the parameters, optimizer state and group counters of the snapshot (and the model's copies
        of the weights)."""
        if not self._snapshot_live:
            raise RuntimeError("no snapshot to restore: the step's bound ruled divergence out")
        for p, old in zip(self._params, self._saved_params, strict=True):
            p.copy_(old)
        for live, saved, devices in self._state:
            for k in [k for k in live if k not in saved]:
                del live[k]
            for k, v in saved.items():
                now = live.get(k)
                if not isinstance(v, Tensor):
                    live[k] = copy.deepcopy(v)
                elif isinstance(now, Tensor) and now.shape == v.shape and now.dtype == v.dtype:
                    now.copy_(v)
                else:  # the step replaced the tensor: a new one where the old one lived
                    live[k] = v.to(devices[k], copy=True)
        for group, saved in self._groups:
            for k in [k for k in group if k != "params" and k not in saved]:
                del group[k]
            group.update(copy.deepcopy(saved))
        for opt, p in self._fresh:
            opt.state.pop(p, None)
        for leaf in _leaves(self.optimizer):
            # Mixed precision: the model's bf16 weights are copies of the fp32 main params just restored.
            model_copy = getattr(leaf, "_copy_main_params_to_model_params", None)
            if model_copy is not None:
                model_copy()
        self._snapshot_live = False
