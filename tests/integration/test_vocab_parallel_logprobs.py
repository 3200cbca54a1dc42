"""Vocabulary-parallel log-probs on two gloo ranks equal a single-rank log-softmax, padding included."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from miles_lite.net.ports import LOCAL_HOST, free_port
from miles_lite.trainer.logprobs import vocab_parallel_logprobs

REAL_VOCAB = 13  # 2 ranks x 8 columns: rank 1 holds 5 real columns and 3 padding columns
COLS = 8


def _case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(6, 2 * COLS, generator=gen, dtype=torch.float64) * 3
    logits[:, REAL_VOCAB:] = 40.0  # padding scores must not count
    targets = torch.randint(0, REAL_VOCAB, (6,), generator=gen)
    targets[0], targets[1] = 0, REAL_VOCAB - 1  # first and last real columns, on different ranks
    weights = torch.linspace(-1, 2, 6, dtype=torch.float64)
    return logits, targets, weights


def _loss(lp: torch.Tensor, ent: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return (lp * weights).sum() + 0.25 * ent.sum()


def _worker(rank: int, port: int, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        logits, targets, weights = _case()
        mine = logits[:, rank * COLS:(rank + 1) * COLS].clone().requires_grad_(True)
        lp, ent = vocab_parallel_logprobs(mine, targets, rank * COLS, REAL_VOCAB, dist.group.WORLD, True)
        assert ent is not None
        _loss(lp, ent, weights).backward()
        out[rank] = (lp.detach(), ent.detach(), mine.grad.clone())
    finally:
        dist.destroy_process_group()


@pytest.mark.integration
def test_two_ranks_equal_one_rank_values_and_gradients() -> None:
    manager = mp.Manager()
    out = manager.dict()
    mp.spawn(_worker, args=(free_port(LOCAL_HOST), out), nprocs=2, join=True)
    logits, targets, weights = _case()
    ref_in = logits.clone().requires_grad_(True)
    logp_all = ref_in[:, :REAL_VOCAB].log_softmax(-1)
    ref_lp = logp_all.gather(-1, targets[:, None])[:, 0]
    ref_ent = -(logp_all.exp() * logp_all).sum(-1)
    _loss(ref_lp, ref_ent, weights).backward()
    assert ref_in.grad is not None
    for rank in (0, 1):
        lp, ent, grad = out[rank]
        torch.testing.assert_close(lp, ref_lp.detach(), rtol=0, atol=1e-12)
        torch.testing.assert_close(ent, ref_ent.detach(), rtol=0, atol=1e-12)
        torch.testing.assert_close(grad, ref_in.grad[:, rank * COLS:(rank + 1) * COLS], rtol=0, atol=1e-12)
    assert not out[1][2][:, REAL_VOCAB - COLS:].any()  # padding columns get no gradient
