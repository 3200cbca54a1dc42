"""Distributed transport: a torch.distributed group with the engines (gloo on CPU, NCCL on GPU).

The group is built the way SGLang's `init_weights_update_group` builds it: this process is rank 0,
engine k's TP rank r is `rank_offset_k + r` with `rank_offset_k = 1 + sum(tp of engines before k)`,
world size `1 + sum(tp)`; each engine joins through its HTTP endpoint *while* rank 0 joins here
(the rendezvous needs everybody), so the HTTP calls are submitted first and collected afterwards.
Per bucket, the update call is posted to every engine, then the data moves, then the answers are
collected (an engine answers only after it has received and loaded).

Modes:
- full (SGLang-compatible, `load_format=None`): every full HF tensor is broadcast from rank 0 to
  all engine ranks; each engine's own loader slices it.
- shard (`load_format=SHARD_LOAD_FORMAT`): each engine rank receives only its local shards, as one
  flat byte buffer per bucket sent point-to-point from rank 0 (`receive_shards` is the engine side).
  Requests carry the rank-local shapes (equal on every rank of an engine).

A changed fleet means a new world: `connect` destroys the group on every engine still reachable
and locally, then builds a fresh one under a new group name and port.
"""

from __future__ import annotations

import math
import socket
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist

from miles_lite.rollout.weight_group import init_custom_process_group
from miles_lite.weight_sync.buckets import Bucket, full_buckets, shard_buckets
from miles_lite.weight_sync.plan import ParamSpec, RankPlan, ReshardPlan, apply_rank_plan, build_plan, full_tensor_plan
from miles_lite.weight_sync.sglang_payloads import SHARD_LOAD_FORMAT
from miles_lite.weight_sync.transport import (
    EngineLoop,
    FleetEngine,
    PushReport,
    ShardSource,
    TransportState,
    WeightSyncError,
    WeightTransport,
    resolve_shards,
)

MODES = ("full", "shard")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free at the time of asking (the rendezvous binds it right after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Concatenate the raw bytes of `tensors` (any dtypes) into one uint8 tensor, in order."""
    return torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for t in tensors])


def unflatten(flat: torch.Tensor, names: Sequence[str], dtypes: Sequence[torch.dtype],
              shapes: Sequence[Sequence[int]]) -> list[tuple[str, torch.Tensor]]:
    """Inverse of `flatten`: views of `flat` with the given dtypes and shapes."""
    out, offset = [], 0
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        out.append((name, flat[offset:offset + nbytes].view(dtype).reshape(list(shape))))
        offset += nbytes
    if offset != flat.numel():
        raise ValueError(f"flat buffer holds {flat.numel()} bytes but the tensors need {offset}")
    return out


def receive_shards(group: dist.ProcessGroup, names: Sequence[str], dtypes: Sequence[str],
                   shapes: Sequence[Sequence[int]], device: str | torch.device = "cpu"
                   ) -> list[tuple[str, torch.Tensor]]:
    """Engine side of the shard mode: one flat buffer of this rank's shards, received from rank 0.

    `dtypes` are torch dtype names; `shapes` are this rank's local shard shapes, in elements.
    """
    torch_dtypes = []
    for name, d in zip(names, dtypes, strict=True):
        dtype = getattr(torch, str(d).removeprefix("torch."), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"dtype {d!r} of {name!r} is not a torch dtype name")
        torch_dtypes.append(dtype)
    total = sum(math.prod(s) * torch.empty((), dtype=d).element_size() for s, d in zip(shapes, torch_dtypes,
                                                                                        strict=True))
    flat = torch.empty(total, dtype=torch.uint8, device=device)
    dist.recv(flat, src=0, group=group)
    return [(n, t.clone()) for n, t in unflatten(flat, names, torch_dtypes, shapes)]


class DistributedTransport(WeightTransport):
    """Rank 0 of a weight-update group with every engine rank of the fleet."""

    name = "distributed"

    def __init__(self, specs: Sequence[ParamSpec], trainer_tp: int, loop: EngineLoop, *, bucket_bytes: int,
                 mode: str = "shard", backend: str = "gloo", master_address: str = "127.0.0.1",
                 group_name: str = "miles_lite_weights", init_timeout_s: float = 120.0,
                 device: str | torch.device = "cpu") -> None:
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"weight_sync.mode={mode!r}; use one of {MODES}")
        self.specs = tuple(specs)
        self.trainer_tp = trainer_tp
        self.loop = loop
        self.bucket_bytes = bucket_bytes
        self.mode = mode
        self.backend = backend
        self.master_address = master_address
        self.group_base = group_name
        self.init_timeout_s = init_timeout_s
        self.device = torch.device(device)
        self.full_plan = full_tensor_plan(self.specs, trainer_tp)
        self.plan: ReshardPlan | None = None
        self.group: dist.ProcessGroup | None = None
        self.group_name = ""
        self.generation = 0
        self.rank_offsets: dict[str, int] = {}

    # ---- lifecycle ------------------------------------------------------------------------------

    def connect(self, fleet_engines: Sequence[FleetEngine]) -> None:
        """(Re)build the group for exactly `fleet_engines`; blocks until every engine rank has joined."""
        self._require(TransportState.NEW, TransportState.CONNECTED, TransportState.FAILED)
        self._teardown()
        self._set_fleet(fleet_engines)
        self.plan = build_plan(self.specs, self.trainer_tp, [f.spec for f in self.fleet])
        offset, self.rank_offsets = 1, {}
        for f in self.fleet:
            self.rank_offsets[f.engine_id] = offset
            offset += f.spec.tp
        world = offset
        self.generation += 1
        self.group_name = f"{self.group_base}_{self.generation}"
        port = free_port(self.master_address)
        futures = {f.engine_id: self.loop.submit(f.engine.init_weights_update_group(
            self.master_address, port, self.rank_offsets[f.engine_id], world, self.group_name, self.backend))
            for f in self.fleet}
        try:
            self.group = init_custom_process_group(self.backend, self.master_address, port, 0, world,
                                                   self.group_name, self.init_timeout_s)
        except Exception as exc:  # the rendezvous timed out or broke: report which engines never answered
            self.state = TransportState.FAILED
            pending = sorted(eid for eid, fut in futures.items() if not fut.done())
            raise WeightSyncError(f"weight-update group {self.group_name} (world {world}) did not form: {exc!r}; "
                                  f"engines still joining: {pending}") from exc
        try:
            self.loop.gather(futures)
        except WeightSyncError:
            self.state = TransportState.FAILED
            raise
        self.state = TransportState.CONNECTED

    def close(self) -> None:
        """Destroy the group here and on every engine (idempotent)."""
        self._teardown()
        self.state = TransportState.CLOSED

    def _teardown(self) -> None:
        if self.group is None:
            return
        futures = {f.engine_id: self.loop.submit(f.engine.destroy_weights_update_group(self.group_name))
                   for f in self.fleet}
        dist.destroy_process_group(self.group)
        self.group = None
        for fut in futures.values():
            # A dead engine cannot leave the group; its replacement joins the next one.
            fut.exception(self.loop.timeout_s)

    # ---- push -----------------------------------------------------------------------------------

    def push(self, named_shards: ShardSource, version: str) -> PushReport:
        """Send every bucket to every engine; the last bucket flushes the engines' caches."""
        self._require(TransportState.CONNECTED)
        version = str(version)
        report = PushReport(version, f"{self.name}/{self.mode}", tuple(f.engine_id for f in self.fleet))
        shards = resolve_shards(named_shards, report)
        if len(shards) != self.trainer_tp:
            raise WeightSyncError(f"push got {len(shards)} trainer shards for trainer tp={self.trainer_tp}")
        assert self.plan is not None
        buckets = full_buckets(self.full_plan, self.bucket_bytes) if self.mode == "full" else \
            shard_buckets(self.plan, self.bucket_bytes)
        report.buckets = len(buckets)
        try:
            for bucket in buckets:
                last = bucket.index == len(buckets) - 1
                if self.mode == "full":
                    self._push_full(bucket, shards, version, last, report)
                else:
                    self._push_shard(bucket, shards, version, last, report)
        except Exception:
            self.state = TransportState.FAILED
            raise
        return report

    def _post(self, bucket_calls: dict[str, Any]) -> dict[str, Future[Any]]:
        return {eid: self.loop.submit(call) for eid, call in bucket_calls.items()}

    def _push_full(self, bucket: Bucket, shards: Any, version: str, last: bool, report: PushReport) -> None:
        with report.phase("convert"):
            tensors = apply_rank_plan(self.full_plan, shards, bucket.names, self.device)
        names = list(tensors)
        dtypes = [str(t.dtype).removeprefix("torch.") for t in tensors.values()]
        shapes = [list(t.shape) for t in tensors.values()]
        with report.phase("transfer"):
            futures = self._post({f.engine_id: f.engine.update_weights_from_distributed(
                names, dtypes, shapes, self.group_name, version, flush_cache=last) for f in self.fleet})
            handles = [dist.broadcast(t, src=0, group=self.group, async_op=True) for t in tensors.values()]
            for handle in handles:
                handle.wait()
        with report.phase("load"):
            self.loop.gather(futures)
        report.bytes += sum(t.numel() * t.element_size() for t in tensors.values())

    def _push_shard(self, bucket: Bucket, shards: Any, version: str, last: bool, report: PushReport) -> None:
        assert self.plan is not None
        per_rank: list[tuple[int, torch.Tensor]] = []
        calls: dict[str, Any] = {}
        with report.phase("convert"):
            for f, rank_plans in zip(self.fleet, self.plan.ranks, strict=True):
                meta = _bucket_meta(rank_plans[0], bucket)
                calls[f.engine_id] = f.engine.update_weights_from_distributed(
                    *meta, self.group_name, version, flush_cache=last, load_format=SHARD_LOAD_FORMAT)
                for rp in rank_plans:
                    local = apply_rank_plan(rp, shards, bucket.names, self.device)
                    per_rank.append((self.rank_offsets[f.engine_id] + rp.rank, flatten(list(local.values()))))
        with report.phase("transfer"):
            futures = self._post(calls)
            handles = [dist.isend(flat, dst=dst, group=self.group) for dst, flat in per_rank]
            for handle in handles:
                handle.wait()
        with report.phase("load"):
            self.loop.gather(futures)
        report.bytes += sum(flat.numel() for _, flat in per_rank)


def _bucket_meta(rank_plan: RankPlan, bucket: Bucket) -> tuple[list[str], list[str], list[list[int]]]:
    """names, dtypes, local shapes of a bucket's shards on one engine rank, in plan order."""
    wanted = set(bucket.names)
    shards = [s for s in rank_plan.shards if s.name in wanted]
    return [s.name for s in shards], [s.dtype for s in shards], [list(s.shape) for s in shards]
