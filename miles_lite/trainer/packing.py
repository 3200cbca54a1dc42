"""Group ragged sequences into micro-batches by token budget, in two layouts.

Every micro-batch is described in packed order (`PackedMicroBatch`: sequences concatenated,
positions restarting at 0 for each), which is the order log-prob and loss code read. How the model
sees it depends on the layer spec:

- TransformerEngine spec: one packed row `[1, T]`, attention restricted to each sequence by THD
  `cu_seqlens`. Only real tokens are computed; the budget counts real tokens.
- Local spec: megatron-core 0.16.1's `DotProductAttention.forward` asserts `packed_seq_params is
  None`, so a packed row would need a `[T, T]` block-diagonal mask and attention over all T^2 pairs.
  Instead the sequences run as a right-padded batch `[B, S]` (`padded_layout`) under a causal mask:
  attention costs B * S^2, and the budget counts padding too (B * S tokens are computed).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


def plan_micro_batches(lengths: Sequence[int], token_budget: int, padded: bool = False) -> list[list[int]]:
    """Group sequence indices into micro-batches of at most `token_budget` tokens (first-fit decreasing).

    `padded`: a micro-batch costs (sequences x its longest length), the tokens of its right-padded
    `[B, S]` batch, instead of the sum of its lengths. Taking sequences longest first, each
    micro-batch's first sequence is its longest, and a padded micro-batch fills with a run of
    similar lengths (little padding).

    A sequence longer than the budget gets a micro-batch of its own (sequences are never split).
    Deterministic: the same lengths always give the same plan. Indices inside a micro-batch are
    in ascending order.
    """
    if token_budget < 1:
        raise ValueError(f"trainer.micro_batch_tokens={token_budget} must be >= 1")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in order:
        for b, load in enumerate(loads):
            cost = lengths[bins[b][0]] * (len(bins[b]) + 1) if padded else load + lengths[i]
            if cost <= token_budget:
                bins[b].append(i)
                loads[b] += lengths[i]
                break
        else:
            bins.append([i])
            loads.append(lengths[i])
    return [sorted(b) for b in bins]


def split_for_data_parallel(lengths: Sequence[int], dp_size: int) -> list[list[int]]:
    """Assign sequences to `dp_size` data-parallel ranks, balancing tokens (longest first, least loaded).

    Every rank sees the same assignment given the same lengths. A rank may get no sequence when
    there are fewer sequences than ranks.
    """
    if dp_size < 1:
        raise ValueError(f"dp_size={dp_size} must be >= 1")
    shares: list[list[int]] = [[] for _ in range(dp_size)]
    loads = [0] * dp_size
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(dp_size), key=lambda r: (loads[r], r))
        shares[r].append(i)
        loads[r] += lengths[i]
    return [sorted(s) for s in shares]


@dataclass(frozen=True)
class PackedMicroBatch:
    """Sequences packed into one row.

    Attributes:
        seq_indices: batch indices of the packed sequences, in row order.
        tokens: `[1, T]` int64 token ids, T = sum of lengths.
        position_ids: `[1, T]` int64 positions, restarting at 0 for each sequence.
        cu_seqlens: `[n + 1]` int32 cumulative sequence starts (THD layout).
        lengths / prompt_lengths: per packed sequence, tokens and prompt tokens.
        pad_rows / pad_width: extra all-padding rows, and a least width, of the padded layout (expert
            parallelism needs one shape on every rank of a forward: `expert_parallel.align_micro_batches`).
        filler: a stand-in run only so that collectives match across ranks; its results are dropped.
    """

    seq_indices: tuple[int, ...]
    tokens: Tensor
    position_ids: Tensor
    cu_seqlens: Tensor
    lengths: tuple[int, ...]
    prompt_lengths: tuple[int, ...]
    pad_rows: int = 0
    pad_width: int = 0
    filler: bool = False

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[1])

    @property
    def response_lengths(self) -> tuple[int, ...]:
        return tuple(n - p for n, p in zip(self.lengths, self.prompt_lengths, strict=True))

    def attention_mask(self) -> Tensor:
        """`[1, 1, T, T]` bool, True where attention is forbidden (other sequence or future token).

        The mask of the packed row on the local spec (`forward.packed_row_hidden_states`)."""
        seq_id = torch.repeat_interleave(torch.arange(len(self.lengths)), torch.tensor(self.lengths))
        same = seq_id[:, None] == seq_id[None, :]
        causal = torch.ones(self.num_tokens, self.num_tokens, dtype=torch.bool).tril()
        return ~(same & causal)[None, None]

    @property
    def padded_shape(self) -> tuple[int, int]:
        """`[B, S]` of `padded_layout`."""
        return len(self.lengths) + self.pad_rows, max(max(self.lengths), self.pad_width)

    def padded_layout(self) -> tuple[Tensor, Tensor, Tensor]:
        """The sequences as a right-padded batch.

        Returns:
            `(tokens, position_ids, valid)`, each `[B, S]` (S = the longest length): token ids with 0
            as padding, positions `0..S-1` in every row, and True at the real tokens. Row-major
            `valid` order is the packed order: `x[valid]` of a `[B, S, ...]` tensor is `[T, ...]`.
        """
        width = max(max(self.lengths), self.pad_width)
        lens = torch.tensor(list(self.lengths) + [0] * self.pad_rows)
        valid = torch.arange(width)[None, :] < lens[:, None]
        tokens = torch.zeros((len(lens), width), dtype=torch.long)
        tokens[valid] = self.tokens[0]
        positions = torch.arange(width).expand(len(lens), -1)
        return tokens, positions, valid

    def response_positions(self) -> tuple[Tensor, Tensor]:
        """Where the response tokens are predicted.

        Returns:
            `(logit_pos, targets)`, both `[R]` int64 with R = sum of response lengths, in sequence
            order: the logits at row position `logit_pos[j]` predict token `targets[j]`.
        """
        # Sequence i's j-th response token is predicted at row position start_i + plen_i - 1 + j.
        plens = torch.tensor(self.prompt_lengths, dtype=torch.long)
        resp = torch.tensor(self.lengths, dtype=torch.long) - plens
        logit_pos = ragged_ranges(self.cu_seqlens[: len(self.lengths)].long() + plens - 1, resp)
        return logit_pos, self.tokens[0, logit_pos + 1]


def pack(tokens: Sequence[Sequence[int]], prompt_lengths: Sequence[int], indices: Sequence[int]) -> PackedMicroBatch:
    """Pack the sequences `indices` of a batch into one row.

    Each packed sequence needs a prompt of at least one token (the first response token is
    predicted from the last prompt position).
    """
    if not indices:
        raise ValueError("pack() needs at least one sequence")
    lengths, plens, flat = [], [], []
    for i in indices:
        seq, plen = tokens[i], prompt_lengths[i]
        if not 1 <= plen <= len(seq):
            raise ValueError(
                f"sequence {i}: prompt_lengths={plen} must be in [1, {len(seq)}] (a response is predicted "
                "from at least one prompt token)"
            )
        lengths.append(len(seq))
        plens.append(plen)
        flat.extend(seq)
    lens = torch.tensor(lengths, dtype=torch.long)
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lens, 0)
    positions = ragged_ranges(torch.zeros_like(lens), lens)  # restarting at 0 for each sequence
    return PackedMicroBatch(
        seq_indices=tuple(indices),
        tokens=torch.tensor([flat], dtype=torch.long),
        position_ids=positions[None],
        cu_seqlens=cu,
        lengths=tuple(lengths),
        prompt_lengths=tuple(plens),
    )


def ragged_ranges(starts: Tensor, lengths: Tensor) -> Tensor:
    """`cat([arange(s, s + n) for s, n in zip(starts, lengths)])` (int64, on the host) in a handful of
    whole-batch ops instead of one `arange` per sequence: these run for every micro-batch of a step."""
    return torch.arange(int(lengths.sum())) + torch.repeat_interleave(starts - (torch.cumsum(lengths, 0) - lengths),
                                                                      lengths)


def to_device(t: Tensor, device: torch.device | str) -> Tensor:
    """A host tensor on `device` without waiting for the device: a plain host-to-GPU copy synchronises the
    stream (the host then waits for every kernel queued before it), so a CUDA copy goes through pinned memory
    and `non_blocking` (the caching host allocator keeps the staging buffer until the copy has run)."""
    device = torch.device(device)
    if device.type != "cuda" or t.device == device:
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


@dataclass(frozen=True)
class PaddedLayout:
    """Where the elements of a flat ragged tensor `[sum(lengths), ...]` go in its right-padded `[B, W, ...]` form
    (W = the longest length): one flat index, so padding is one kernel forward and one backward, where a copy per
    row (`pad_sequence`) costs B kernels forward and B full-size `CopySlices` nodes in the backward, for every
    micro-batch of a step.

    Attributes:
        rows / width: B and W.
        index: `[sum(lengths)]` int64, each element's row-major position in `[B * W]` (packed order).
    """

    rows: int
    width: int
    index: Tensor

    @staticmethod
    def of(lengths: Sequence[int], device: torch.device | str | None = None) -> PaddedLayout:
        """The layout of `lengths`, its index built on the host and sent to `device` (default: stays on the host)."""
        lens = torch.tensor(list(lengths), dtype=torch.long)
        width = int(lens.max()) if len(lens) else 0
        index = ragged_ranges(torch.arange(len(lens)) * width, lens)
        return PaddedLayout(len(lens), width, index if device is None else to_device(index, device))

    def pad(self, values: Tensor) -> Tensor:
        """`values [sum(lengths), ...]` -> `[B, W, ...]`, zeros in the padding (autograd-safe)."""
        tail = tuple(values.shape[1:])
        flat = values.new_zeros((self.rows * self.width, *tail))
        return flat.index_copy(0, self.index, values).view(self.rows, self.width, *tail)

    def mask(self) -> Tensor:
        """`[B, W]` float32 on the index's device: 1.0 at the real elements, 0.0 in the padding."""
        flat = torch.zeros(self.rows * self.width, dtype=torch.float32, device=self.index.device)
        return flat.index_fill_(0, self.index, 1.0).view(self.rows, self.width)


def to_padded(values: Tensor, lengths: Sequence[int]) -> tuple[Tensor, Tensor]:
    """Flat per-token values `[sum(lengths)]` -> padded `[B, max_len]` values (autograd-safe) and a float mask."""
    layout = PaddedLayout.of(lengths, values.device)
    return layout.pad(values), layout.mask()


def padded_floats(rows: Sequence[Sequence[float]], dtype: torch.dtype = torch.float32) -> Tensor:
    """Ragged float lists -> `[B, max_len]` zero-padded tensor (on the host)."""
    layout = PaddedLayout.of([len(r) for r in rows])
    return layout.pad(torch.tensor(list(itertools.chain.from_iterable(rows)), dtype=dtype))
