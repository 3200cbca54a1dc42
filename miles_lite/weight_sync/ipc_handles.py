"""CUDA IPC transport by driver-level handle, for engines whose torch build differs from the trainer's.

`weight_sync.transport=ipc_handles`. Each bucket's per-engine-rank tensors (already fused and sharded
the way SGLang's parameters are, as for `load_format="direct"`) are packed into one device buffer the
trainer allocated with `cuMemAlloc`; every engine TP rank receives the buffer's 64-byte IPC handle
and the offsets of its parameters, maps the buffer and copies them in
(`miles_lite.engines.sglang.ipc_loader.load_ipc_weights`, which the engine must list in
`--custom-weight-loader`). Unlike `ipc` (torch's own pickled CUDA tensors), nothing depends on both
sides running the same torch. The buffer is kept between pushes and grown when a bucket needs more.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from miles_lite.config.schema import IPC_HANDLES_LOADER
from miles_lite.weight_sync.cuda_ipc import ExportedBuffer, encode_request, layout_slots, slot_view
from miles_lite.weight_sync.ipc import IpcTransport, direct_named_tensors, serialize_named_tensors
from miles_lite.weight_sync.plan import ParamSpec, apply_rank_plan
from miles_lite.weight_sync.transport import (
    EngineLoop,
    PushReport,
    ShardSource,
    TransportState,
)

LOADER = IPC_HANDLES_LOADER


class IpcHandleTransport(IpcTransport):
    """Per-engine-rank slots of one shared device buffer, handed to colocated engines by IPC handle."""

    name = "ipc_handles"

    def __init__(self, specs: Sequence[ParamSpec], trainer_tp: int, loop: EngineLoop, *, bucket_bytes: int,
                 device: str | torch.device = "cuda") -> None:
        super().__init__(specs, trainer_tp, loop, bucket_bytes=bucket_bytes, device=device)
        self.buffer: ExportedBuffer | None = None

    def _buffer(self, nbytes: int) -> ExportedBuffer:
        if self.buffer is None or self.buffer.nbytes < nbytes:
            if self.buffer is not None:
                self.buffer.close()
            self.buffer = ExportedBuffer(nbytes, self.device)
        return self.buffer

    def push(self, named_shards: ShardSource, version: str) -> PushReport:
        """Per bucket: pack every engine rank's tensors into the shared buffer, then one
        `update_weights_from_tensor` per engine naming the loader (fused parameters kept in one bucket)."""
        report, shards, buckets = self._start_push(named_shards, version)
        try:
            for i, names in enumerate(buckets):
                with report.phase("convert"):
                    per_rank = [[direct_named_tensors(rp, self.specs, apply_rank_plan(rp, shards, names, self.device))
                                 for rp in rank_plans] for rank_plans in self.plan.ranks]
                    layouts = [[layout_slots(named) for named in ranks] for ranks in per_rank]
                    total = sum(size for ranks in layouts for _, size in ranks)
                    buf = self._buffer(max(total, 1))
                    assert buf.tensor is not None
                    payloads: dict[str, list[str]] = {}
                    base = 0
                    for f, ranks, rank_layouts in zip(self.fleet, per_rank, layouts, strict=True):
                        entries = []
                        for named, (slots, size) in zip(ranks, rank_layouts, strict=True):
                            region = buf.tensor[base:base + size]
                            for (_, t), slot in zip(named, slots, strict=True):
                                slot_view(region, slot).copy_(t)
                            shifted = [type(s)(s.param, s.offset + base, s.dtype, s.shape) for s in slots]
                            entries.append(serialize_named_tensors(encode_request(buf.handle, buf.nbytes, shifted)))
                            base += size
                        payloads[f.engine_id] = entries
                    report.bytes += sum(t.numel() * t.element_size() for ranks in per_rank for named in ranks
                                        for _, t in named)
                    del per_rank
                    self._copies_landed()  # the engines read the buffer from their own streams
                with report.phase("load"):
                    self.loop.gather({f.engine_id: self.loop.submit(f.engine.update_weights_from_tensor(
                        payloads[f.engine_id], LOADER, report.version, flush_cache=i == len(buckets) - 1))
                        for f in self.fleet})
        except Exception:
            self.state = TransportState.FAILED
            raise
        return report

    def close(self) -> None:
        if self.buffer is not None:
            self.buffer.close()
            self.buffer = None
        self.state = TransportState.CLOSED
