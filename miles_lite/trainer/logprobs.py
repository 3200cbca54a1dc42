"""Token log-probabilities and entropy from vocabulary-parallel logits, in token chunks.

Each TP rank holds the logits of its vocabulary slice `[vocab_start, vocab_start + V_local)`. The
log-softmax is assembled across ranks like megatron's `vocab_parallel_cross_entropy`: a global max
(all-reduce MAX), a global sum of exponentials and the target's logit (all-reduce SUM, differentiable).
Columns at or past `real_vocab` (vocabulary padding, or a teacher's extra rows) are excluded from
the softmax. Logits are projected from hidden states `chunk_tokens` tokens at a time, under
activation checkpointing when gradients are needed, so fp32 scores over the whole vocabulary exist
for at most one chunk at a time, in the forward and in the backward pass.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils.checkpoint import checkpoint


def _reduce_sum(x: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """All-reduce SUM across TP ranks; the backward is the identity (each rank owns its slice)."""
    if group is None or dist.get_world_size(group) == 1:
        return x
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    return reduce_from_tensor_model_parallel_region(x, group=group)


def vocab_parallel_logprobs(
    logits: Tensor,
    targets: Tensor,
    vocab_start: int,
    real_vocab: int,
    group: dist.ProcessGroup | None,
    with_entropy: bool,
) -> tuple[Tensor, Tensor | None]:
    """Log-prob of `targets` and entropy under softmax over the first `real_vocab` columns.

    Args:
        logits: `[N, V_local]` this rank's vocabulary slice (any float dtype; computed in fp32).
        targets: `[N]` int64 global token ids, each < `real_vocab`.
        vocab_start: global id of column 0 of this slice.
        real_vocab: columns counted in the softmax (global ids `[0, real_vocab)`).
        group: the TP process group (None: a single rank holds the whole vocabulary).
        with_entropy: also return the per-token entropy.

    Returns:
        `(logp [N], entropy [N] or None)`, fp32, nats; differentiable w.r.t. `logits`.
    """
    x = logits.float()
    v_local = x.shape[-1]
    valid = (torch.arange(v_local, device=x.device) + vocab_start) < real_vocab  # [V_local]
    with torch.no_grad():
        gmax = x.masked_fill(~valid, float("-inf")).amax(dim=-1)
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(gmax, op=dist.ReduceOp.MAX, group=group)
    # Padding columns become 0 before exp and are zeroed after it: no -inf enters the graph, so
    # neither the forward nor the backward can produce NaN from them.
    shifted = torch.where(valid, x - gmax[:, None], torch.zeros_like(x))
    exp = torch.where(valid, shifted.exp(), torch.zeros_like(x))
    sum_exp = _reduce_sum(exp.sum(dim=-1), group)
    local_t = targets - vocab_start
    owned = (local_t >= 0) & (local_t < v_local)
    picked = shifted.gather(-1, local_t.clamp(0, v_local - 1)[:, None]).squeeze(-1)
    target_logit = _reduce_sum(torch.where(owned, picked, torch.zeros_like(picked)), group)
    log_z = sum_exp.log()
    logp = target_logit - log_z
    if not with_entropy:
        return logp, None
    weighted = _reduce_sum((exp * shifted).sum(dim=-1), group)
    return logp, log_z - weighted / sum_exp


def chunked_logprobs(
    hidden: Tensor,
    targets: Tensor,
    project: Callable[[Tensor], Tensor],
    vocab_start: int,
    real_vocab: int,
    group: dist.ProcessGroup | None,
    chunk_tokens: int,
    with_entropy: bool,
) -> tuple[Tensor, Tensor | None]:
    """`vocab_parallel_logprobs` over hidden states, `chunk_tokens` tokens at a time.

    Args:
        hidden: `[N, H]` final hidden states at the positions that predict `targets`.
        targets: `[N]` int64 token ids.
        project: hidden `[n, H]` -> this rank's logits `[n, V_local]` (the output layer).
        chunk_tokens: tokens per chunk (`trainer.logprob_chunk_tokens`).

    Returns:
        `(logp [N], entropy [N] or None)`, fp32 nats. With grad enabled, each chunk is recomputed
        in the backward pass instead of keeping its `[n, V_local]` scores alive.
    """
    if chunk_tokens < 1:
        raise ValueError(f"trainer.logprob_chunk_tokens={chunk_tokens} must be >= 1")

    def one_chunk(h: Tensor, t: Tensor) -> tuple[Tensor, Tensor]:
        lp, ent = vocab_parallel_logprobs(project(h), t, vocab_start, real_vocab, group, with_entropy)
        return lp, (ent if ent is not None else torch.zeros_like(lp))

    logps: list[Tensor] = []
    ents: list[Tensor] = []
    for start in range(0, hidden.shape[0], chunk_tokens):
        h = hidden[start:start + chunk_tokens]
        t = targets[start:start + chunk_tokens]
        if torch.is_grad_enabled() and h.requires_grad:
            lp, ent = checkpoint(one_chunk, h, t, use_reentrant=False)
        else:
            lp, ent = one_chunk(h, t)
        logps.append(lp)
        ents.append(ent)
    if not logps:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, (empty if with_entropy else None)
    return torch.cat(logps), (torch.cat(ents) if with_entropy else None)
