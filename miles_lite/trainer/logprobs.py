"""Token log-probabilities and entropy from vocabulary-parallel logits, in token chunks.

Each TP rank holds the logits of its vocabulary slice `[vocab_start, vocab_start + V_local)`. The
log-softmax is assembled across ranks like megatron's `vocab_parallel_cross_entropy`: a global max
(all-reduce MAX), then global sums of exponentials, of the target's logit and of the entropy's
numerator (all-reduce SUM). Columns at or past `real_vocab` (vocabulary padding, or a teacher's extra
rows) are sliced off before the softmax and get a zero gradient.

`VocabParallelLogprob` is one autograd function with a hand-written backward (the gradient of a
log-prob w.r.t. the logits is `onehot - softmax`), so the fp32 softmax over the vocabulary exists for
one chunk at a time and only the chunk's logits (model dtype, bf16 on GPU) are kept for the backward.
With `recompute=True` not even those are kept: each chunk is projected again in the backward pass
(activation checkpointing), for the smallest memory at the price of a second output-layer GEMM. The
two memory-bound cores can be fused by `torch.compile` on GPU (`LogprobKernels`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils.checkpoint import checkpoint

log = logging.getLogger(__name__)

KERNEL_MODES = ("auto", "compiled", "eager")


def compute_dtype(logits: Tensor) -> torch.dtype:
    """fp32 for bf16/fp16/fp32 logits, fp64 for fp64 ones (gradient checks)."""
    return torch.promote_types(logits.dtype, torch.float32)


def _shifted_stats(logits: Tensor, gmax: Tensor, local_t: Tensor, owned: Tensor,
                   with_entropy: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Per-row partial sums over this rank's valid columns, in `compute_dtype`, relative to the global max.

    Args:
        logits: `[n, V_valid]` this rank's valid columns (any float dtype).
        gmax: `[n]` global max over all ranks' valid columns.
        local_t: `[n]` int64 target column on this rank (clamped into range).
        owned: `[n]` bool, whether this rank holds the target column.
        with_entropy: also return `sum(exp(x) * x)` (otherwise zeros).

    Returns:
        `(sum_exp [n], sum_exp_x [n], target_x [n])` with `x = logits - gmax`; `target_x` is 0 where not owned.
    """
    x = logits.to(compute_dtype(logits)) - gmax[:, None]
    e = x.exp()
    sum_exp = e.sum(dim=-1)
    sum_exp_x = (e * x).sum(dim=-1) if with_entropy else torch.zeros_like(sum_exp)
    target_x = torch.where(owned, x.gather(-1, local_t[:, None]).squeeze(-1), torch.zeros_like(sum_exp))
    return sum_exp, sum_exp_x, target_x


def _logits_grad(logits: Tensor, lse: Tensor, g_logp: Tensor, entropy: Tensor, g_entropy: Tensor | None,
                 local_t: Tensor, owned: Tensor) -> Tensor:
    """d(sum g_logp * logp + g_entropy * H) / d logits for this rank's valid columns, in `logits.dtype`.

    With `logq = logits - lse` and `p = exp(logq)`: d logp_t / d x_j = onehot_t(j) - p_j and
    d H / d x_j = -p_j (logq_j + H).

    Args:
        logits: `[n, V_valid]`; lse: `[n]` global log-normalizer; g_logp, entropy: `[n]` in lse's dtype;
        g_entropy: `[n]` or None (entropy not in the loss); local_t / owned as in `_shifted_stats`.
    """
    logq = logits.to(lse.dtype) - lse[:, None]
    p = logq.exp()
    if g_entropy is None:
        grad = p * (-g_logp)[:, None]
    else:
        grad = -p * (g_logp[:, None] + g_entropy[:, None] * (logq + entropy[:, None]))
    onehot = torch.where(owned, g_logp, torch.zeros_like(g_logp))
    grad = grad.scatter_add(-1, local_t[:, None], onehot[:, None])
    return grad.to(logits.dtype)


@dataclass
class LogprobKernels:
    """The two memory-bound cores, eager or fused with `torch.compile`.

    `mode`: "eager"; "compiled" (fail if compilation fails); "auto" (compiled on CUDA, falling back to
    eager with a warning if compilation fails; eager on CPU, where inductor would need a C++ toolchain).
    """

    mode: str = "auto"
    _compiled: dict[Callable[..., Any], Callable[..., Any]] = field(default_factory=dict, repr=False)
    _broken: bool = False

    def __post_init__(self) -> None:
        if self.mode not in KERNEL_MODES:
            raise ValueError(f"trainer.logprob_kernel={self.mode!r} is not one of {', '.join(KERNEL_MODES)}")

    def _use_compiled(self, device: torch.device) -> bool:
        if self.mode == "eager" or self._broken:
            return False
        return self.mode == "compiled" or device.type == "cuda"

    def _call(self, fn: Callable[..., Any], *args: Tensor) -> Any:
        if not self._use_compiled(args[0].device):
            return fn(*args)
        if fn not in self._compiled:
            self._compiled[fn] = torch.compile(fn, dynamic=True)
        try:
            return self._compiled[fn](*args)
        except Exception as exc:  # inductor/triton failures surface at first call
            if self.mode == "compiled":
                raise
            log.warning("torch.compile of the log-prob kernels failed (%s); using eager kernels", exc)
            self._broken = True
            return fn(*args)

    def shifted_stats(self, *args: Any) -> tuple[Tensor, Tensor, Tensor]:
        """`_shifted_stats`, compiled or eager."""
        return self._call(_shifted_stats, *args)

    def logits_grad(self, *args: Any) -> Tensor:
        """`_logits_grad`, compiled or eager."""
        return self._call(_logits_grad, *args)


def _all_reduce(x: Tensor, op: dist.ReduceOp.RedOpType, group: dist.ProcessGroup | None) -> Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(x, op=op, group=group)
    return x


class VocabParallelLogprob(torch.autograd.Function):
    """`(logp [n], entropy [n])` from vocab-parallel logits `[n, V_local]`; see `vocab_parallel_logprobs`."""

    @staticmethod
    def forward(ctx: Any, logits: Tensor, targets: Tensor, vocab_start: int, real_vocab: int,
                group: dist.ProcessGroup | None, with_entropy: bool, kernels: LogprobKernels) -> tuple[Tensor, Tensor]:
        v_local = logits.shape[-1]
        n_valid = max(0, min(v_local, real_vocab - vocab_start))
        valid = logits[:, :n_valid]
        local_t = targets - vocab_start
        owned = (local_t >= 0) & (local_t < n_valid)
        local_t = local_t.clamp(0, max(n_valid - 1, 0))
        if n_valid:
            gmax = valid.amax(dim=-1).to(compute_dtype(logits))
        else:  # a rank holding only padding columns contributes nothing
            gmax = logits.new_full((logits.shape[0],), float("-inf"), dtype=compute_dtype(logits))
        _all_reduce(gmax, dist.ReduceOp.MAX, group)
        if n_valid:
            sum_exp, sum_exp_x, target_x = kernels.shifted_stats(valid, gmax, local_t, owned, with_entropy)
        else:
            sum_exp = sum_exp_x = target_x = torch.zeros_like(gmax)
        # One all-reduce for the three partial sums.
        sums = _all_reduce(torch.stack([sum_exp, sum_exp_x, target_x]), dist.ReduceOp.SUM, group)
        log_z = sums[0].log()
        logp = sums[2] - log_z
        entropy = log_z - sums[1] / sums[0] if with_entropy else torch.zeros_like(logp)
        ctx.save_for_backward(logits, gmax + log_z, entropy, local_t, owned)
        ctx.n_valid, ctx.kernels, ctx.with_entropy = n_valid, kernels, with_entropy
        ctx.set_materialize_grads(False)
        if not with_entropy:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx: Any, g_logp: Tensor | None, g_entropy: Tensor | None) -> tuple[Tensor | None, ...]:
        logits, lse, entropy, local_t, owned = ctx.saved_tensors
        nones = (None,) * 6
        if g_logp is None and (g_entropy is None or not ctx.with_entropy):
            return (None, *nones)
        if g_logp is None:
            g_logp = torch.zeros_like(lse)
        n_valid = ctx.n_valid
        g_ent = g_entropy.to(lse.dtype) if ctx.with_entropy and g_entropy is not None else None
        if n_valid == logits.shape[-1]:
            return (ctx.kernels.logits_grad(logits, lse, g_logp.to(lse.dtype), entropy, g_ent, local_t, owned), *nones)
        grad = torch.zeros_like(logits)
        if n_valid:
            grad[:, :n_valid] = ctx.kernels.logits_grad(logits[:, :n_valid], lse, g_logp.to(lse.dtype), entropy, g_ent,
                                                        local_t, owned)
        return (grad, *nones)


def vocab_parallel_logprobs(
    logits: Tensor,
    targets: Tensor,
    vocab_start: int,
    real_vocab: int,
    group: dist.ProcessGroup | None,
    with_entropy: bool,
    kernels: LogprobKernels | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Log-prob of `targets` and entropy under softmax over the first `real_vocab` columns.

    Args:
        logits: `[N, V_local]` this rank's vocabulary slice (any float dtype; computed in fp32).
        targets: `[N]` int64 global token ids, each < `real_vocab`.
        vocab_start: global id of column 0 of this slice.
        real_vocab: columns counted in the softmax (global ids `[0, real_vocab)`).
        group: the TP process group (None: a single rank holds the whole vocabulary).
        with_entropy: also return the per-token entropy (differentiable: it may enter the loss).
        kernels: eager or compiled cores (default: eager).

    Returns:
        `(logp [N], entropy [N] or None)`, nats, fp32 (fp64 for fp64 logits); differentiable w.r.t. `logits`.
    """
    logp, entropy = VocabParallelLogprob.apply(logits, targets, vocab_start, real_vocab, group, with_entropy,
                                               kernels or LogprobKernels("eager"))
    return logp, (entropy if with_entropy else None)


def chunked_logprobs(
    hidden: Tensor,
    targets: Tensor,
    project: Callable[[Tensor], Tensor],
    vocab_start: int,
    real_vocab: int,
    group: dist.ProcessGroup | None,
    chunk_tokens: int,
    with_entropy: bool,
    recompute: bool = False,
    kernels: LogprobKernels | None = None,
) -> tuple[Tensor, Tensor | None]:
    """`vocab_parallel_logprobs` over hidden states, `chunk_tokens` tokens at a time.

    Args:
        hidden: `[N, H]` final hidden states at the positions that predict `targets`.
        targets: `[N]` int64 token ids.
        project: hidden `[n, H]` -> this rank's logits `[n, V_local]` (the output layer).
        chunk_tokens: tokens per chunk (`trainer.logprob_chunk_tokens`): the fp32 softmax exists for one
            chunk at a time.
        recompute: with grad enabled, keep nothing of a chunk's `[n, V_local]` logits for the backward
            pass and project the chunk again there (`trainer.logprob_recompute`); otherwise each chunk's
            logits are kept in the model's dtype.
        kernels: eager or compiled cores (`trainer.logprob_kernel`).

    Returns:
        `(logp [N], entropy [N] or None)`, fp32 nats, differentiable when grad is enabled.
    """
    if chunk_tokens < 1:
        raise ValueError(f"trainer.logprob_chunk_tokens={chunk_tokens} must be >= 1")
    kernels = kernels or LogprobKernels("eager")

    def one_chunk(h: Tensor, t: Tensor) -> tuple[Tensor, Tensor]:
        return VocabParallelLogprob.apply(project(h), t, vocab_start, real_vocab, group, with_entropy, kernels)

    logps: list[Tensor] = []
    ents: list[Tensor] = []
    for start in range(0, hidden.shape[0], chunk_tokens):
        h = hidden[start:start + chunk_tokens]
        t = targets[start:start + chunk_tokens]
        if recompute and torch.is_grad_enabled() and h.requires_grad:
            lp, ent = checkpoint(one_chunk, h, t, use_reentrant=False)
        else:
            lp, ent = one_chunk(h, t)
        logps.append(lp)
        ents.append(ent)
    if not logps:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, (empty if with_entropy else None)
    return torch.cat(logps), (torch.cat(ents) if with_entropy else None)
