"""Packing ragged sequences into micro-batches: budgets, DP balance, masks and response positions."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from miles_lite.trainer.packing import (
    PaddedLayout,
    pack,
    padded_floats,
    plan_micro_batches,
    split_for_data_parallel,
    to_padded,
)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 50), min_size=1, max_size=30), st.integers(1, 120))
def test_plan_covers_every_sequence_once_within_budget(lengths: list[int], budget: int) -> None:
    plan = plan_micro_batches(lengths, budget)
    assert sorted(i for mb in plan for i in mb) == list(range(len(lengths)))
    for mb in plan:
        # Only a single over-long sequence may exceed the budget.
        assert sum(lengths[i] for i in mb) <= budget or len(mb) == 1
        assert mb == sorted(mb)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 50), min_size=1, max_size=30), st.integers(1, 120))
def test_padded_plan_counts_padding_within_budget(lengths: list[int], budget: int) -> None:
    plan = plan_micro_batches(lengths, budget, padded=True)
    assert sorted(i for mb in plan for i in mb) == list(range(len(lengths)))
    for mb in plan:
        assert len(mb) * max(lengths[i] for i in mb) <= budget or len(mb) == 1


def test_padded_plan_groups_similar_lengths() -> None:
    # 6 + 2 + 2 + 2 real tokens fit 12, but padded to 6 they cost 24: [6, 2] and [2, 2].
    assert plan_micro_batches([6, 2, 2, 2], 12) == [[0, 1, 2, 3]]
    assert plan_micro_batches([6, 2, 2, 2], 12, padded=True) == [[0, 1], [2, 3]]
    assert plan_micro_batches([20, 3, 19, 4], 40, padded=True) == [[0, 2], [1, 3]]


def test_padded_layout_round_trips_to_packed_order() -> None:
    mb = pack([[10, 11, 12, 13], [20, 21, 22], [30, 31]], [2, 1, 1], [0, 2])
    tokens, positions, valid = mb.padded_layout()
    assert tokens.tolist() == [[10, 11, 12, 13], [30, 31, 0, 0]]
    assert positions.tolist() == [[0, 1, 2, 3], [0, 1, 2, 3]]
    assert valid.tolist() == [[True] * 4, [True, True, False, False]]
    assert tokens[valid].tolist() == mb.tokens[0].tolist()
    one = pack([[7, 8, 9]], [1], [0]).padded_layout()
    assert one[0].tolist() == [[7, 8, 9]] and bool(one[2].all())


def test_plan_is_tight_for_a_perfect_fit() -> None:
    assert len(plan_micro_batches([5, 5, 5, 5], 10)) == 2
    assert plan_micro_batches([3, 8, 2], 10) == [[1, 2], [0]]


def test_plan_rejects_a_non_positive_budget() -> None:
    with pytest.raises(ValueError, match="micro_batch_tokens"):
        plan_micro_batches([1], 0)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=0, max_size=25), st.integers(1, 4))
def test_dp_split_is_a_balanced_partition(lengths: list[int], dp: int) -> None:
    shares = split_for_data_parallel(lengths, dp)
    assert len(shares) == dp
    assert sorted(i for s in shares for i in s) == list(range(len(lengths)))
    loads = [sum(lengths[i] for i in s) for s in shares]
    if lengths:
        # Longest-first greedy: no rank exceeds the lightest by more than the longest sequence.
        assert max(loads) - min(loads) <= max(lengths)


def test_pack_mask_positions_and_targets() -> None:
    tokens = [[10, 11, 12, 13], [20, 21, 22], [30, 31]]
    mb = pack(tokens, [2, 1, 1], [0, 2])
    assert mb.tokens.tolist() == [[10, 11, 12, 13, 30, 31]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 0, 1]]
    assert mb.cu_seqlens.tolist() == [0, 4, 6]
    assert mb.response_lengths == (2, 1)
    logit_pos, targets = mb.response_positions()
    assert logit_pos.tolist() == [1, 2, 4] and targets.tolist() == [12, 13, 31]
    mask = mb.attention_mask()[0, 0]
    allowed = ~mask
    assert allowed[5, 4] and allowed[3, 0] and allowed[0, 0]
    assert not allowed[4, 3]  # second sequence cannot see the first
    assert not allowed[0, 1]  # causal
    assert int(allowed.sum()) == 4 * 5 // 2 + 2 * 3 // 2


def test_pack_rejects_an_empty_prompt() -> None:
    with pytest.raises(ValueError, match="prompt_lengths=0"):
        pack([[1, 2, 3]], [0], [0])


def test_to_padded_round_trips_and_keeps_gradients() -> None:
    values = torch.arange(6, dtype=torch.float32, requires_grad=True)
    padded, mask = to_padded(values, [3, 0, 2, 1])
    assert padded.shape == (4, 3)
    assert mask.tolist() == [[1, 1, 1], [0, 0, 0], [1, 1, 0], [1, 0, 0]]
    assert padded[mask > 0].tolist() == [0, 1, 2, 3, 4, 5]
    (padded * mask).sum().backward()
    assert values.grad is not None and values.grad.tolist() == [1.0] * 6


def test_padded_floats() -> None:
    assert padded_floats([[1.0, 2.0], [], [3.0]]).tolist() == [[1.0, 2.0], [0.0, 0.0], [3.0, 0.0]]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 9), min_size=0, max_size=12))
def test_padded_layout_matches_pad_sequence_values_and_gradients(lengths: list[int]) -> None:
    from torch.nn.utils.rnn import pad_sequence

    total = sum(lengths)
    values = torch.randn(total, dtype=torch.float64, requires_grad=True)
    padded, mask = to_padded(values, lengths)
    ref = pad_sequence(list(values.split(lengths)), batch_first=True) if lengths else values.new_zeros((0, 0))
    assert padded.shape == ref.shape and torch.equal(padded, ref)
    assert mask.dtype == torch.float32
    assert mask.tolist() == [[float(j < n) for j in range(ref.shape[1])] for n in lengths]
    if total:
        weights = torch.randn(ref.shape, dtype=torch.float64)
        (grad,) = torch.autograd.grad((padded * weights).sum(), values)
        (ref_grad,) = torch.autograd.grad((ref * weights).sum(), values)
        assert torch.equal(grad, ref_grad)
    rows = [[float(v) for v in torch.randn(n).tolist()] for n in lengths]
    ref_rows = torch.zeros(ref.shape)
    for b, row in enumerate(rows):
        ref_rows[b, : len(row)] = torch.tensor(row)
    assert torch.equal(padded_floats(rows), ref_rows)


def _graph_nodes(t: torch.Tensor) -> int:
    seen, todo = set(), [t.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        todo.extend(next_fn for next_fn, _ in node.next_functions)
    return len(seen)


def test_padding_costs_the_same_for_any_number_of_rows() -> None:
    # Padding runs for every micro-batch of a step: its autograd graph (and so its backward's kernel launches)
    # must not grow with the sequences in the micro-batch, as a copy per row did.
    def nodes(rows: int) -> int:
        values = torch.randn(rows * 5, requires_grad=True)
        return _graph_nodes(PaddedLayout.of([5] * rows).pad(values))

    assert nodes(2) == nodes(64)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 12), st.integers(0, 11)), min_size=1, max_size=10), st.data())
def test_pack_positions_and_response_positions_match_a_per_sequence_reference(
    shapes: list[tuple[int, int]], data: st.DataObject
) -> None:
    lengths = [n for n, _ in shapes]
    plens = [min(max(1, p), n) for n, p in shapes]
    tokens = [[100 * i + j for j in range(n)] for i, n in enumerate(lengths)]
    order = data.draw(st.permutations(range(len(lengths))))
    mb = pack(tokens, plens, order)
    assert mb.position_ids.tolist() == [[j for i in order for j in range(lengths[i])]]
    starts = mb.cu_seqlens.tolist()
    ref = [start + p - 1 + j for start, i in zip(starts, order, strict=False) for p in [plens[i]]
           for j in range(lengths[i] - p)]
    logit_pos, targets = mb.response_positions()
    assert logit_pos.dtype == torch.long and logit_pos.tolist() == ref
    assert targets.tolist() == [tok for i in order for tok in tokens[i][plens[i]:]]
