"""How one Megatron parameter shard maps onto Hugging Face tensors (pure; no torch.distributed).

Every tensor-parallel shard a trainer rank holds covers, for each HF tensor it maps to, one
contiguous slice along one dimension (an `HFPiece`). The layouts:

- `qkv_fused`: Megatron's `linear_qkv` weight/bias, rows grouped per KV head as
  [q heads of the group (heads_per_group * head_dim rows), k (head_dim), v (head_dim)]; TP splits
  whole groups. Maps to HF q_proj / k_proj / v_proj, each a contiguous row range.
- `gate_up_fused`: `linear_fc1`, each rank holds [gate_shard; up_shard]; maps to gate_proj / up_proj.
- `vocab_padded`: embedding / output layer rows, padded to `padded_vocab_size`; rows at or past
  `vocab_size` are padding with no HF counterpart.
- `column_parallel` / `row_parallel`: a plain slice along dim 0 / dim 1.
- `replicated`: every rank holds the whole tensor (norm weights).

A routed expert's fc1/fc2 (MoE) is `gate_up_fused` / `replicated` at tp_size 1: expert tensor
parallelism is 1, expert parallelism places whole experts (`ParamLayout.expert`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

import torch
from torch import Tensor


class LayoutKind(StrEnum):
    QKV_FUSED = "qkv_fused"
    GATE_UP_FUSED = "gate_up_fused"
    VOCAB_PADDED = "vocab_padded"
    COLUMN_PARALLEL = "column_parallel"
    ROW_PARALLEL = "row_parallel"
    REPLICATED = "replicated"


@dataclass(frozen=True)
class HFPiece:
    """Rows/columns `[start, stop)` along `dim` of the full HF tensor `hf_name`."""

    hf_name: str
    dim: int
    start: int
    stop: int


@dataclass(frozen=True)
class ParamLayout:
    """Metadata of one Megatron parameter shard on one tensor-parallel rank.

    Attributes:
        megatron_name: name in `GPTModel.named_parameters()` (e.g. `decoder.layers.0.mlp.linear_fc1.weight`).
        kind: the `LayoutKind` (see the module docstring).
        hf_names: HF tensor names it maps to, in fused order (q, k, v / gate, up / one name).
        hf_shapes: full shape of each HF tensor, aligned with `hf_names`.
        full_shape: shape of the unsharded Megatron tensor (vocabulary padding included).
        local_shape: shape of this rank's shard.
        partition_dim: dimension TP splits (None when replicated).
        tp_rank / tp_size: this shard's tensor-parallel coordinates.
        num_heads / num_kv_heads / head_dim: set for `qkv_fused` (model-wide counts).
        vocab_size / padded_vocab_size: set for `vocab_padded` (real / padded rows).
        expert: the global index of a routed expert's weight (None elsewhere). Experts are whole on
            their expert-parallel rank (tp_rank 0 of tp_size 1), and the Megatron name holds the local
            index, so the same name means another expert on another EP rank.
    """

    megatron_name: str
    kind: LayoutKind
    hf_names: tuple[str, ...]
    hf_shapes: tuple[tuple[int, ...], ...]
    full_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    partition_dim: int | None
    tp_rank: int
    tp_size: int
    num_heads: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None
    vocab_size: int | None = None
    padded_vocab_size: int | None = None
    expert: int | None = None

    def __post_init__(self) -> None:
        if len(self.hf_names) != len(self.hf_shapes):
            raise ValueError(f"{self.megatron_name}: {len(self.hf_names)} hf_names but {len(self.hf_shapes)} shapes")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"{self.megatron_name}: tp_rank={self.tp_rank} outside tp_size={self.tp_size}")

    # ---- geometry -------------------------------------------------------------------------------

    def _qkv_rows(self) -> tuple[int, int, int]:
        """(first KV group, local KV groups, query heads per group) of this shard."""
        assert self.num_heads and self.num_kv_heads and self.head_dim
        groups = self.num_kv_heads // self.tp_size
        return self.tp_rank * groups, groups, self.num_heads // self.num_kv_heads

    def pieces(self) -> tuple[HFPiece, ...]:
        """The HF slices this shard holds, in `split()` order (empty for an all-padding vocab shard)."""
        n_local = self.local_shape[self.partition_dim] if self.partition_dim is not None else 0
        if self.kind is LayoutKind.QKV_FUSED:
            g0, groups, qpg = self._qkv_rows()
            hd = self.head_dim or 0
            q, k, v = self.hf_names
            return (HFPiece(q, 0, g0 * qpg * hd, (g0 + groups) * qpg * hd),
                    HFPiece(k, 0, g0 * hd, (g0 + groups) * hd),
                    HFPiece(v, 0, g0 * hd, (g0 + groups) * hd))
        if self.kind is LayoutKind.GATE_UP_FUSED:
            half = n_local // 2
            r = self.tp_rank
            return tuple(HFPiece(name, 0, r * half, (r + 1) * half) for name in self.hf_names)
        if self.kind is LayoutKind.VOCAB_PADDED:
            start = self.tp_rank * n_local
            stop = min(start + n_local, self.vocab_size or 0)
            return (HFPiece(self.hf_names[0], 0, start, stop),) if stop > start else ()
        if self.kind is LayoutKind.REPLICATED:
            return (HFPiece(self.hf_names[0], 0, 0, self.hf_shapes[0][0]),)
        dim = 0 if self.kind is LayoutKind.COLUMN_PARALLEL else 1
        return (HFPiece(self.hf_names[0], dim, self.tp_rank * n_local, (self.tp_rank + 1) * n_local),)

    # ---- conversion -----------------------------------------------------------------------------

    def split(self, local: Tensor) -> list[tuple[HFPiece, Tensor]]:
        """Cut this rank's shard (shape `local_shape`) into its HF pieces (views where possible)."""
        if tuple(local.shape) != self.local_shape:
            raise ValueError(f"{self.megatron_name}: shard shape {tuple(local.shape)} != layout {self.local_shape}")
        pieces = self.pieces()
        if self.kind is LayoutKind.QKV_FUSED:
            _, groups, qpg = self._qkv_rows()
            hd = self.head_dim or 0
            rest = tuple(local.shape[1:])
            grouped = local.reshape(groups, qpg + 2, hd, *rest)
            parts = (grouped[:, :qpg], grouped[:, qpg:qpg + 1], grouped[:, qpg + 1:])
            return [(p, t.reshape(-1, *rest)) for p, t in zip(pieces, parts, strict=True)]
        if self.kind is LayoutKind.GATE_UP_FUSED:
            half = local.shape[0] // 2
            return [(pieces[0], local[:half]), (pieces[1], local[half:])]
        if self.kind is LayoutKind.VOCAB_PADDED:
            return [(pieces[0], local[: pieces[0].stop - pieces[0].start])] if pieces else []
        return [(pieces[0], local)]

    def assemble(self, hf: Mapping[str, Tensor]) -> Tensor:
        """Build this rank's shard from full HF tensors (padding rows are zero). Bit-exact copy."""
        out: list[Tensor] = []
        for piece in self.pieces():
            if piece.hf_name not in hf:
                raise KeyError(f"{self.megatron_name} needs HF tensor {piece.hf_name!r}, which the checkpoint lacks")
            out.append(hf[piece.hf_name].narrow(piece.dim, piece.start, piece.stop - piece.start))
        if self.kind is LayoutKind.QKV_FUSED:
            _, groups, qpg = self._qkv_rows()
            hd = self.head_dim or 0
            rest = tuple(out[0].shape[1:])
            q = out[0].reshape(groups, qpg, hd, *rest)
            k = out[1].reshape(groups, 1, hd, *rest)
            v = out[2].reshape(groups, 1, hd, *rest)
            shard = torch.cat([q, k, v], dim=1).reshape(self.local_shape)
        elif self.kind is LayoutKind.GATE_UP_FUSED:
            shard = torch.cat(out, dim=0)
        elif self.kind is LayoutKind.VOCAB_PADDED:
            dtype = hf[self.hf_names[0]].dtype
            shard = torch.zeros(self.local_shape, dtype=dtype)
            if out:
                shard[: out[0].shape[0]] = out[0]
        else:
            shard = out[0]
        if tuple(shard.shape) != self.local_shape:
            raise ValueError(
                f"{self.megatron_name}: HF tensors give a shard of shape {tuple(shard.shape)}, expected "
                f"{self.local_shape}; the checkpoint's config.json does not match its weights"
            )
        return shard.contiguous()


def merge_shards(layouts: Sequence[ParamLayout], shards: Sequence[Tensor]) -> dict[str, Tensor]:
    """Full HF tensors of one Megatron parameter from the shards of all its TP ranks (any order).

    Args:
        layouts: the parameter's `ParamLayout` on each TP rank.
        shards: the matching local tensors.

    Returns:
        `{hf_name: tensor}` with each tensor at its full HF shape (padding rows dropped).
    """
    if not layouts:
        raise ValueError("merge_shards needs at least one shard")
    first = layouts[0]
    if first.kind is LayoutKind.REPLICATED:
        return {first.hf_names[0]: shards[0].clone()}
    if sorted(lay.tp_rank for lay in layouts) != list(range(first.tp_size)):
        raise ValueError(f"{first.megatron_name}: need one shard per TP rank 0..{first.tp_size - 1}")
    full = {name: torch.empty(shape, dtype=shards[0].dtype) for name, shape in
            zip(first.hf_names, first.hf_shapes, strict=True)}
    for layout, shard in zip(layouts, shards, strict=True):
        for piece, part in layout.split(shard):
            full[piece.hf_name].narrow(piece.dim, piece.start, piece.stop - piece.start).copy_(part)
    return full
