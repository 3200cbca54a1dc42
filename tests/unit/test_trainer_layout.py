"""ParamLayout: Megatron shard <-> HF slices for fused QKV (GQA), gate/up, vocab padding, row/column splits."""

from __future__ import annotations

import pytest
import torch

from miles_lite.trainer.layout import LayoutKind, ParamLayout, merge_shards


def _layout(kind: LayoutKind, hf_names: tuple[str, ...], hf_shapes: tuple[tuple[int, ...], ...],
            local: tuple[int, ...], full: tuple[int, ...], dim: int | None, rank: int, tp: int,
            **kw: int) -> ParamLayout:
    return ParamLayout("p", kind, hf_names, hf_shapes, full, local, dim, rank, tp, **kw)


def _megatron_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
    """Reference Megatron layout: per KV group, its query heads then its k head then its v head."""
    qg = q.reshape(groups, -1, *q.shape[1:])
    kg = k.reshape(groups, -1, *k.shape[1:])
    vg = v.reshape(groups, -1, *v.shape[1:])
    return torch.cat([qg, kg, vg], dim=1).reshape(-1, *q.shape[1:])


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("with_hidden", [True, False])
def test_qkv_split_assemble_and_merge(tp: int, with_hidden: bool) -> None:
    heads, kv, hd, hidden = 8, 4, 3, 5
    rest = (hidden,) if with_hidden else ()
    q, k, v = torch.randn(heads * hd, *rest), torch.randn(kv * hd, *rest), torch.randn(kv * hd, *rest)
    full = _megatron_qkv(q, k, v, kv)
    rows = full.shape[0] // tp
    hf = {"q": q, "k": k, "v": v}
    layouts, shards = [], []
    for r in range(tp):
        lay = _layout(LayoutKind.QKV_FUSED, ("q", "k", "v"), (tuple(q.shape), tuple(k.shape), tuple(v.shape)),
                      (rows, *rest), tuple(full.shape), 0, r, tp, num_heads=heads, num_kv_heads=kv, head_dim=hd)
        shard = lay.assemble(hf)
        assert torch.equal(shard, full[r * rows:(r + 1) * rows])
        for piece, part in lay.split(shard):
            assert torch.equal(part, hf[piece.hf_name].narrow(0, piece.start, piece.stop - piece.start))
        layouts.append(lay)
        shards.append(shard)
    merged = merge_shards(layouts[::-1], shards[::-1])
    assert all(torch.equal(merged[n], hf[n]) for n in hf)


def test_gate_up_shards_hold_gate_then_up() -> None:
    gate, up = torch.randn(6, 4), torch.randn(6, 4)
    lays = [_layout(LayoutKind.GATE_UP_FUSED, ("g", "u"), ((6, 4), (6, 4)), (6, 4), (12, 4), 0, r, 2) for r in (0, 1)]
    shard1 = lays[1].assemble({"g": gate, "u": up})
    assert torch.equal(shard1, torch.cat([gate[3:], up[3:]]))
    merged = merge_shards(lays, [lay.assemble({"g": gate, "u": up}) for lay in lays])
    assert torch.equal(merged["g"], gate) and torch.equal(merged["u"], up)


def test_vocab_padding_rows_are_zero_and_dropped() -> None:
    emb = torch.randn(5, 3)
    lays = [_layout(LayoutKind.VOCAB_PADDED, ("e",), ((5, 3),), (4, 3), (8, 3), 0, r, 2, vocab_size=5,
                    padded_vocab_size=8) for r in (0, 1)]
    assert [p.stop - p.start for p in lays[1].pieces()] == [1]
    shard1 = lays[1].assemble({"e": emb})
    assert torch.equal(shard1[0], emb[4]) and not shard1[1:].any()
    merged = merge_shards(lays, [lay.assemble({"e": emb}) for lay in lays])
    assert torch.equal(merged["e"], emb)


def test_all_padding_shard_has_no_pieces() -> None:
    lay = _layout(LayoutKind.VOCAB_PADDED, ("e",), ((3, 2),), (4, 2), (8, 2), 0, 1, 2, vocab_size=3,
                  padded_vocab_size=8)
    assert lay.pieces() == ()
    assert lay.split(torch.zeros(4, 2)) == []


def test_row_parallel_splits_columns() -> None:
    w = torch.randn(4, 6)
    lays = [_layout(LayoutKind.ROW_PARALLEL, ("o",), ((4, 6),), (4, 3), (4, 6), 1, r, 2) for r in (0, 1)]
    assert torch.equal(lays[1].assemble({"o": w}), w[:, 3:])
    assert torch.equal(merge_shards(lays, [lay.assemble({"o": w}) for lay in lays])["o"], w)


def test_shape_mismatch_names_the_parameter() -> None:
    lay = _layout(LayoutKind.REPLICATED, ("n",), ((4,),), (4,), (4,), None, 0, 1)
    with pytest.raises(ValueError, match="p: shard shape"):
        lay.split(torch.zeros(5))
    with pytest.raises(KeyError, match="lacks"):
        lay.assemble({})
    with pytest.raises(ValueError, match="one shard per TP rank"):
        lays = [_layout(LayoutKind.ROW_PARALLEL, ("o",), ((4, 6),), (4, 3), (4, 6), 1, 0, 2)]
        merge_shards(lays, [torch.zeros(4, 3)])
