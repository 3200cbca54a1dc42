"""Chunked log-probs / entropy with vocabulary padding excluded, against plain torch log_softmax."""

from __future__ import annotations

import pytest
import torch

from miles_lite.trainer.logprobs import chunked_logprobs, vocab_parallel_logprobs


def _reference(logits: torch.Tensor, targets: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    logp_all = logits[:, :vocab].float().log_softmax(-1)
    return logp_all.gather(-1, targets[:, None])[:, 0], -(logp_all.exp() * logp_all).sum(-1)


def test_padding_columns_never_enter_the_softmax() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(9, 16, generator=gen) * 3
    logits[:, 11:] = 50.0  # padding rows with huge scores must be ignored
    targets = torch.randint(0, 11, (9,), generator=gen)
    lp, ent = vocab_parallel_logprobs(logits, targets, 0, 11, None, with_entropy=True)
    ref_lp, ref_ent = _reference(logits, targets, 11)
    assert ent is not None
    torch.testing.assert_close(lp, ref_lp, rtol=0, atol=1e-6)
    torch.testing.assert_close(ent, ref_ent, rtol=0, atol=1e-5)


def test_gradients_match_log_softmax_and_stay_finite() -> None:
    gen = torch.Generator().manual_seed(1)
    base = torch.randn(5, 12, generator=gen)
    targets = torch.randint(0, 10, (5,), generator=gen)
    a = base.clone().requires_grad_(True)
    lp, ent = vocab_parallel_logprobs(a, targets, 0, 10, None, with_entropy=True)
    assert ent is not None
    (lp.sum() + 0.3 * ent.sum()).backward()
    b = base.clone().requires_grad_(True)
    ref_lp, ref_ent = _reference(b, targets, 10)
    (ref_lp.sum() + 0.3 * ref_ent.sum()).backward()
    assert a.grad is not None and b.grad is not None
    assert torch.isfinite(a.grad).all()
    assert not a.grad[:, 10:].any()
    torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-5)


@pytest.mark.parametrize("chunk", [1, 4, 1000])
def test_chunked_equals_unchunked_values_and_gradients(chunk: int) -> None:
    gen = torch.Generator().manual_seed(2)
    proj = torch.nn.Linear(8, 24, bias=False)
    hidden_base = torch.randn(13, 8, generator=gen)
    targets = torch.randint(0, 20, (13,), generator=gen)

    def run(chunk_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        proj.zero_grad()
        hidden = hidden_base.clone().requires_grad_(True)
        lp, ent = chunked_logprobs(hidden, targets, proj, 0, 20, None, chunk_tokens, with_entropy=True)
        assert ent is not None
        (lp * torch.linspace(-1, 1, 13)).sum().add(ent.mean()).backward()
        assert hidden.grad is not None and proj.weight.grad is not None
        return lp.detach(), ent.detach(), hidden.grad.clone(), proj.weight.grad.clone()

    full = run(10**6)
    chunked = run(chunk)
    for x, y in zip(full, chunked, strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-6)


def test_no_grad_path_and_empty_input() -> None:
    proj = torch.nn.Linear(4, 6, bias=False)
    with torch.no_grad():
        lp, ent = chunked_logprobs(torch.randn(3, 4), torch.tensor([0, 1, 5]), proj, 0, 6, None, 2, False)
    assert lp.shape == (3,) and ent is None
    lp, ent = chunked_logprobs(torch.zeros(0, 4), torch.zeros(0, dtype=torch.long), proj, 0, 6, None, 2, True)
    assert lp.shape == (0,) and ent is not None and ent.shape == (0,)
    with pytest.raises(ValueError, match="logprob_chunk_tokens"):
        chunked_logprobs(torch.zeros(1, 4), torch.zeros(1, dtype=torch.long), proj, 0, 6, None, 0, False)


@pytest.mark.parametrize("with_entropy", [False, True])
def test_recompute_equals_kept_logits(with_entropy: bool) -> None:
    gen = torch.Generator().manual_seed(3)
    proj = torch.nn.Linear(8, 24, bias=False)
    hidden_base = torch.randn(11, 8, generator=gen)
    targets = torch.randint(0, 20, (11,), generator=gen)

    def run(recompute: bool) -> list[torch.Tensor]:
        proj.zero_grad()
        hidden = hidden_base.clone().requires_grad_(True)
        lp, ent = chunked_logprobs(hidden, targets, proj, 0, 20, None, 4, with_entropy, recompute=recompute)
        loss = (lp * torch.linspace(-1, 1, 11)).sum()
        if ent is not None:
            loss = loss + 0.5 * ent.sum()
        loss.backward()
        assert hidden.grad is not None and proj.weight.grad is not None
        return [lp.detach(), hidden.grad.clone(), proj.weight.grad.clone()]

    for x, y in zip(run(False), run(True), strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-6)


def test_hand_written_backward_passes_gradcheck() -> None:
    gen = torch.Generator().manual_seed(4)
    logits = (torch.randn(4, 9, generator=gen, dtype=torch.float64) * 2).requires_grad_(True)
    targets = torch.randint(0, 7, (4,), generator=gen)

    def f(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        lp, ent = vocab_parallel_logprobs(x, targets, 0, 7, None, with_entropy=True)
        assert ent is not None
        return lp, ent

    assert torch.autograd.gradcheck(f, (logits,), eps=1e-6, atol=1e-6)


def test_entropy_kept_out_of_the_loss_costs_no_gradient_term() -> None:
    gen = torch.Generator().manual_seed(5)
    base = torch.randn(6, 10, generator=gen)
    targets = torch.randint(0, 10, (6,), generator=gen)
    a = base.clone().requires_grad_(True)
    lp, ent = vocab_parallel_logprobs(a, targets, 0, 10, None, with_entropy=True)
    assert ent is not None
    lp.sum().backward()  # entropy only read as a statistic
    b = base.clone().requires_grad_(True)
    _reference(b, targets, 10)[0].sum().backward()
    assert a.grad is not None and b.grad is not None
    torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-6)
    torch.testing.assert_close(ent, _reference(base, targets, 10)[1], rtol=0, atol=1e-5)


def test_unknown_kernel_mode_names_the_field() -> None:
    from miles_lite.trainer.logprobs import LogprobKernels

    with pytest.raises(ValueError, match="trainer.logprob_kernel"):
        LogprobKernels("fused")
