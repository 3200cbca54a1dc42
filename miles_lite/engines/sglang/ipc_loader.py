"""The weight loader stock SGLang loads as a plugin for same-GPU pushes by CUDA IPC handle.

Started with `--custom-weight-loader miles_lite.engines.sglang.ipc_loader.load_ipc_weights`; SGLang 0.5.10
(`ModelRunner.update_weights_from_tensor`) then calls `load_ipc_weights(model, named_tensors)` in every
TP worker when `/update_weights_from_tensor` names it as `load_format`, rank r's `named_tensors`
decoded from `serialized_named_tensors[r]`. The request (`weight_sync.cuda_ipc`) names a buffer of the
trainer's process by its driver-level IPC handle and where each of this rank's (fused, sharded)
parameters lies in it; the worker maps the buffer, copies every slot into its parameter on the GPU,
waits for the copies and unmaps. Nothing here depends on which torch build the trainer runs.

SGLang answers success whatever happens short of an exception, so every slot is checked against the
parameter it names before anything is copied; the probe log-probs after each push catch the rest.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from miles_lite.weight_sync.cuda_ipc import ImportedBuffer, decode_request, slot_view


def load_ipc_weights(model: Any, named_tensors: Sequence[tuple[str, Any]]) -> list[str]:
    """Copy the pushed slots into `model`'s parameters in place; returns the parameter names loaded."""
    handle, size, slots = decode_request(named_tensors)
    params = dict(model.named_parameters())
    problems = []
    for s in slots:
        p = params.get(s.param)
        if p is None:
            problems.append(f"{s.param}: no such parameter")
        elif tuple(p.shape) != s.shape:  # dtypes may differ: copy_ casts, as SGLang's own loaders do
            problems.append(f"{s.param}: pushed shape {list(s.shape)}, engine holds {list(p.shape)}")
    if problems:
        raise ValueError("the pushed weights do not fit this engine's parameters: " + "; ".join(problems[:5]))
    device = next(iter(params.values())).device
    with ImportedBuffer(handle, size, device) as shared, torch.no_grad():
        assert shared.tensor is not None
        for s in slots:
            params[s.param].data.copy_(slot_view(shared.tensor, s))
    return [s.param for s in slots]
