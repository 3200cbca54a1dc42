"""The IPC push request (handle + slots in a tensor name) and the engine loader's checks, without a GPU."""

from __future__ import annotations

import base64
import io
import pickle

import pytest
import torch

from miles_lite.engines.sglang.ipc_loader import load_ipc_weights
from miles_lite.weight_sync.cuda_ipc import ALIGN, decode_request, encode_request, layout_slots, slot_view
from miles_lite.weight_sync.ipc import serialize_named_tensors


def _named() -> list[tuple[str, torch.Tensor]]:
    return [("a", torch.randn(3, 5).to(torch.bfloat16)), ("b", torch.randn(7)), ("c", torch.randn(2, 2, 2))]


def test_slots_are_aligned_and_round_trip_through_a_flat_buffer() -> None:
    named = _named()
    slots, total = layout_slots(named)
    assert [s.offset % ALIGN for s in slots] == [0, 0, 0] and total == 3 * ALIGN
    base = torch.zeros(total, dtype=torch.uint8)
    for (_, t), s in zip(named, slots, strict=True):
        slot_view(base, s).copy_(t)
    for (_, t), s in zip(named, slots, strict=True):
        assert torch.equal(slot_view(base, s), t) and slot_view(base, s).dtype == t.dtype
    with pytest.raises(ValueError, match="int64"):
        layout_slots([("x", torch.zeros(2, dtype=torch.int64))])


def test_request_survives_sglang_style_serialisation() -> None:
    slots, total = layout_slots(_named())
    handle = bytes(range(64))
    payload = serialize_named_tensors(encode_request(handle, total, slots))
    named = pickle.Unpickler(io.BytesIO(base64.b64decode(payload))).load()  # SGLang's deserialize, minus its allow-list
    assert named[0][1].numel() == 0  # an empty tensor: plain bytes, no shared memory
    got_handle, got_total, got_slots = decode_request(named)
    assert (got_handle, got_total, got_slots) == (handle, total, slots)


def test_decode_names_foreign_and_out_of_range_payloads() -> None:
    with pytest.raises(ValueError, match="one tensor named"):
        decode_request([("model.embed_tokens.weight", torch.zeros(1))])
    slots, total = layout_slots(_named())
    with pytest.raises(ValueError, match="does not fit"):
        decode_request(encode_request(b"\0" * 64, total - ALIGN, slots))


def test_loader_checks_every_slot_before_mapping_anything() -> None:
    model = torch.nn.Module()
    model.register_parameter("w", torch.nn.Parameter(torch.zeros(4, 4)))
    slots, total = layout_slots([("w", torch.zeros(4, 5)), ("missing", torch.zeros(2))])
    with pytest.raises(ValueError, match=r"w: pushed shape \[4, 5\], engine holds \[4, 4\]; missing: no such"):
        load_ipc_weights(model, encode_request(b"\0" * 64, total, slots))
