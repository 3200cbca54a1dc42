"""CUDA IPC transport for colocated engines: SGLang's `update_weights_from_tensor`, `load_format="direct"`.

Each engine TP rank gets its own payload (entry i of `serialized_named_tensors`), holding only its
shards already fused the way SGLang's parameters are (`qkv_proj` = [q; k; v] of the rank,
`gate_up_proj` = [gate; up], vocab rows padded), so `direct` copies them straight into the
parameters (`model_runner._model_load_weights_direct`) without any slicing on the engine.
Payloads are `base64(ForkingPickler(list[(name, tensor)]))`, SGLang's
`MultiprocessingSerializer.serialize(..., output_str=True)`: CUDA tensors travel as IPC handles,
so the tensors must stay alive until the engine has answered. GPU only.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Sequence
from multiprocessing.reduction import ForkingPickler

import torch

from miles_lite.weight_sync.buckets import shard_buckets
from miles_lite.weight_sync.engine_layout import expert_counts, expert_index, sglang_param_name
from miles_lite.weight_sync.plan import ParamSpec, RankPlan, apply_rank_plan, build_plan, fused_offset
from miles_lite.weight_sync.transport import (
    EngineLoop,
    FleetEngine,
    PushReport,
    ShardSource,
    TrainerShards,
    TransportState,
    WeightSyncError,
    WeightTransport,
    resolve_shards,
)


def serialize_named_tensors(named: Sequence[tuple[str, torch.Tensor]]) -> str:
    """SGLang's `MultiprocessingSerializer.serialize(named, output_str=True)`."""
    buf = io.BytesIO()
    ForkingPickler(buf).dump(list(named))
    return base64.b64encode(buf.getvalue()).decode("utf-8")


def direct_named_tensors(rank_plan: RankPlan, specs: Sequence[ParamSpec], local: dict[str, torch.Tensor]
                         ) -> list[tuple[str, torch.Tensor]]:
    """Fuse one engine rank's HF-named local shards into SGLang parameters (names, shapes) for `direct`.

    A fused parameter is emitted only when all its parts are in `local` (a bucket never splits one:
    parts of a fused parameter must be bucketed together by the caller); a MoE layer's routed experts
    are stacked in expert order, each expert's parts fused ([gate; up]).
    """
    by_name = {s.name: s for s in specs}
    num_experts = expert_counts(specs)
    # target -> expert (-1: not an expert) -> (offset, tensor) parts
    fused: dict[str, dict[int, list[tuple[int, torch.Tensor]]]] = {}
    for shard in rank_plan.shards:
        if shard.name not in local:
            continue
        parts = fused.setdefault(sglang_param_name(shard.name), {}).setdefault(expert_index(shard.name), [])
        parts.append((fused_offset(by_name[shard.name], rank_plan.tp), local[shard.name]))
    out = []
    for target, experts in fused.items():
        cats = {e: _cat_parts(parts) for e, parts in experts.items()}
        if -1 in cats:
            out.append((target, cats[-1]))
            continue
        missing = sorted(set(range(num_experts[target])) - set(cats))
        if missing:
            raise WeightSyncError(f"{target}: this bucket lacks experts {missing[:8]}; every expert of a layer "
                                  "must travel in one bucket")
        out.append((target, torch.stack([cats[e] for e in range(num_experts[target])])))
    return out


def _cat_parts(parts: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
    """One fused tensor from its (offset, tensor) parts, in offset order."""
    parts = sorted(parts, key=lambda p: p[0])
    return parts[0][1] if len(parts) == 1 else torch.cat([t for _, t in parts], dim=0)


class IpcTransport(WeightTransport):
    """Per-TP-rank CUDA tensors handed to colocated SGLang engines by IPC handle."""

    name = "ipc"

    def __init__(self, specs: Sequence[ParamSpec], trainer_tp: int, loop: EngineLoop, *, bucket_bytes: int,
                 device: str | torch.device = "cuda") -> None:
        super().__init__()
        if not torch.cuda.is_available():
            raise WeightSyncError(f"weight_sync.transport={self.name} needs CUDA (colocated GPU engines); use "
                                  "'distributed' or 'disk' on CPU")
        self.specs = tuple(specs)
        self.trainer_tp = trainer_tp
        self.loop = loop
        self.bucket_bytes = bucket_bytes
        self.device = torch.device(device)

    def _copies_landed(self) -> None:
        """Wait for this push's device work, queued on the current stream. Only that stream: a device-wide wait
        would also wait for the host copies a checkpoint's save queued on the trainer's offload stream."""
        torch.cuda.current_stream(self.device).synchronize()

    def connect(self, fleet_engines: Sequence[FleetEngine]) -> None:
        self._require(TransportState.NEW, TransportState.CONNECTED, TransportState.FAILED)
        self._set_fleet(fleet_engines)
        self.plan = build_plan(self.specs, self.trainer_tp, [f.spec for f in self.fleet])
        self.state = TransportState.CONNECTED

    def _start_push(self, named_shards: ShardSource, version: str
                    ) -> tuple[PushReport, TrainerShards, list[tuple[str, ...]]]:
        """The push's report, its resolved shards and its buckets (every fused parameter whole in one)."""
        self._require(TransportState.CONNECTED)
        report = PushReport(str(version), self.name, tuple(f.engine_id for f in self.fleet))
        shards = resolve_shards(named_shards, report)
        buckets = _fused_whole(shard_buckets(self.plan, self.bucket_bytes))
        report.buckets = len(buckets)
        return report, shards, buckets

    def push(self, named_shards: ShardSource, version: str) -> PushReport:
        """One `update_weights_from_tensor` per engine per bucket (fused parameters kept in one bucket)."""
        report, shards, buckets = self._start_push(named_shards, version)
        try:
            for i, names in enumerate(buckets):
                payloads: dict[str, list[str]] = {}
                keep_alive: list[torch.Tensor] = []
                with report.phase("convert"):
                    for f, rank_plans in zip(self.fleet, self.plan.ranks, strict=True):
                        per_rank = []
                        for rp in rank_plans:
                            named = direct_named_tensors(rp, self.specs,
                                                         apply_rank_plan(rp, shards, names, self.device))
                            keep_alive += [t for _, t in named]
                            per_rank.append(serialize_named_tensors(named))
                        payloads[f.engine_id] = per_rank
                report.bytes += sum(t.numel() * t.element_size() for t in keep_alive)
                with report.phase("load"):
                    self.loop.gather({f.engine_id: self.loop.submit(f.engine.update_weights_from_tensor(
                        payloads[f.engine_id], "direct", report.version, flush_cache=i == len(buckets) - 1))
                        for f in self.fleet})
                self._copies_landed()
        except Exception:
            self.state = TransportState.FAILED
            raise
        return report

    def close(self) -> None:
        self.state = TransportState.CLOSED


def _fused_whole(buckets: Sequence) -> list[tuple[str, ...]]:
    """Bucket names, with every fused parameter's parts moved into the bucket of its first part."""
    out: list[list[str]] = []
    home: dict[str, int] = {}
    for bucket in buckets:
        out.append([])
        for name in bucket.names:
            target = sglang_param_name(name)
            idx = home.setdefault(target, len(out) - 1)
            out[idx].append(name)
    return [tuple(names) for names in out if names]
