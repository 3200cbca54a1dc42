"""Statistics that stay on the device until they are read: a training step's scalars cost one host sync.

Reading a CUDA scalar (`float(t)`, `.item()`, `.tolist()`) waits for every kernel queued before it. The loss
functions of `algo` return their statistics as 0-d tensors (`*_terms` functions); the float-returning
functions read them here, and a trainer step reads all of its micro-batches' statistics at once, after the
last backward, so the host keeps queueing work while the device computes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

DeviceStats = dict[str, Tensor]


def read_stats(stats: Mapping[str, Tensor | float]) -> dict[str, float]:
    """`stats` as floats, in their order: every tensor value read in one host transfer per device."""
    return read_many([stats])[0]


def read_many(many: Sequence[Mapping[str, Tensor | float]]) -> list[dict[str, float]]:
    """Each mapping of `many` as floats, in its own key order; all tensor values read in one host transfer per
    device they live on (0-d or one-element tensors, read in float64)."""
    by_device: dict[torch.device, list[tuple[int, str, Tensor]]] = {}
    for i, stats in enumerate(many):
        for key, value in stats.items():
            if isinstance(value, Tensor):
                by_device.setdefault(value.device, []).append((i, key, value))
    read: dict[tuple[int, str], float] = {}
    for entries in by_device.values():
        values = torch.stack([v.detach().reshape(()).to(torch.float64) for _, _, v in entries]).tolist()
        read.update({(i, key): value for (i, key, _), value in zip(entries, values, strict=True)})
    return [{key: read[(i, key)] if isinstance(value, Tensor) else float(value) for key, value in stats.items()}
            for i, stats in enumerate(many)]
