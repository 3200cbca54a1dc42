"""Distributed transport: a torch.distributed group with the engines (gloo on CPU, NCCL on GPU).

The group is built the way SGLang's `init_weights_update_group` builds it: engine k's TP rank r is
`rank_offset_k + r`, offsets packed after the senders; each engine joins through its HTTP endpoint
*while* the senders join here (the rendezvous needs everybody), so the HTTP calls are submitted
first and collected afterwards. Per bucket, the update call is posted to every engine, then the data
moves, then the answers are collected (an engine answers only after it has received and loaded).

Modes:
- full (SGLang-compatible, `load_format=None`): this process is rank 0 (world `1 + sum(tp)`), gathers
  the trainer shards, and broadcasts every full HF tensor to all engine ranks; each engine's own
  loader slices it.
- shard (stock SGLang with the project's weight-loader plugin, and the reference engine, which runs
  the same plugin): the trainer's senders themselves are ranks `0..S-1` (the TP ranks of data-parallel
  rank 0, then the holders of routed experts on other expert-parallel ranks: `plan.sender_count`; world
  `S + sum(tp)`) and each sends every engine rank the slices it holds, point to point
  (`shard_protocol`). The engines are driven through `/update_weights_from_tensor` with
  `load_format=LOADER_FUNCTION`: one request per engine TP rank (`loader_protocol`) to join the group
  at `connect`, one per bucket naming that rank's shards and blocks, one to leave. This process only
  posts those requests, tells the trainer ranks which bucket to send and waits for the answers.

A changed fleet means a new world: `connect` destroys the group on every engine still reachable
and on the senders, then builds a fresh one under a new group name and port.

The group's store listens only while the group forms (`weight_group.form_group`): `connect` returns with
it closed. Except with SGLang's own group join (full mode on SGLang engines, `engine_warm_up=False`):
its ranks create their communicator at the first broadcast, so this process keeps the store up until
the first bucket of the first push has reached every engine, then closes it.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist

from miles_lite.net.ports import free_port
from miles_lite.weight_sync.buckets import Bucket, full_buckets, shard_buckets
from miles_lite.weight_sync.loader_protocol import (
    LOADER_FUNCTION,
    LoaderRequest,
    join_request,
    leave_request,
    rank_params,
    receive_request,
    serialize,
)
from miles_lite.weight_sync.plan import (
    ParamSpec,
    ReshardPlan,
    apply_rank_plan,
    build_plan,
    full_tensor_plan,
    sender_count,
)
from miles_lite.weight_sync.senders import ShardSenders
from miles_lite.weight_sync.shard_protocol import RankSchedule, bucket_schedules
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
from miles_lite.weight_sync.weight_group import FormedGroup, WarmUp, form_group

logger = logging.getLogger(__name__)

MODES = ("full", "shard")


class DistributedTransport(WeightTransport):
    """A weight-update group with every engine rank of the fleet (full: this process sends; shard: the senders)."""

    name = "distributed"

    def __init__(self, specs: Sequence[ParamSpec], trainer_tp: int, loop: EngineLoop, *, bucket_bytes: int,
                 mode: str = "shard", backend: str = "gloo", master_address: str | None = None,
                 group_name: str = "miles_lite_weights", init_timeout_s: float = 120.0,
                 device: str | torch.device = "cpu", senders: ShardSenders | None = None,
                 group_key: str | None = None, engine_warm_up: bool = True) -> None:
        """`group_key`: the run's API key, which every rank of the group presents (None: no admission check).
        `engine_warm_up` (full mode): the engines join through this project's group code, which warms the group
        up while it forms; False for SGLang's own join, which does not (see the module docstring)."""
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"weight_sync.mode={mode!r}; use one of {MODES}")
        if mode == "shard" and senders is None:
            raise ValueError("weight_sync.mode='shard' sends from the trainer ranks: pass senders= (the trainer "
                             "role), or use mode='full'")
        if mode == "full" and not master_address:
            raise ValueError("weight_sync.mode='full' hosts the group in this process: pass master_address= (the "
                             "address the engines reach this process at)")
        self.specs = tuple(specs)
        self.trainer_tp = trainer_tp
        self.num_senders = sender_count(self.specs, trainer_tp)
        self.loop = loop
        self.bucket_bytes = bucket_bytes
        self.mode = mode
        self.senders = senders
        self.backend = backend
        self.master_address = master_address
        # This transport's own names: a trainer restarted after a crash never names a group its predecessor
        # left on the engines (an engine refuses to join a group name it still holds).
        self.group_base = f"{group_name}_{secrets.token_hex(3)}"
        self.init_timeout_s = init_timeout_s
        self._group_key = group_key
        self.engine_warm_up = engine_warm_up
        self._formed: FormedGroup | None = None
        self.endpoint: tuple[str, int] | None = None  # the current group's rendezvous (address, port)
        self.device = torch.device(device)
        self.full_plan = full_tensor_plan(self.specs, trainer_tp)
        self.plan: ReshardPlan | None = None
        self.group: dist.ProcessGroup | None = None
        self.senders_joined = False
        self.group_name = ""
        self.generation = 0
        self.rank_offsets: dict[str, int] = {}
        self.buckets: list[Bucket] = []
        self.schedules: list[list[RankSchedule]] = []

    # ---- lifecycle ------------------------------------------------------------------------------

    def connect(self, fleet_engines: Sequence[FleetEngine]) -> None:
        """(Re)build the group for exactly `fleet_engines`; blocks until every rank has joined."""
        self._require(TransportState.NEW, TransportState.CONNECTED, TransportState.FAILED)
        self._teardown()
        self._set_fleet(fleet_engines)
        self.plan = build_plan(self.specs, self.trainer_tp, [f.spec for f in self.fleet])
        first = 1 if self.mode == "full" else self.num_senders
        offset, self.rank_offsets = first, {}
        for f in self.fleet:
            self.rank_offsets[f.engine_id] = offset
            offset += f.spec.tp
        world = offset
        if self.mode == "full":
            self.buckets = full_buckets(self.full_plan, self.bucket_bytes)
        else:
            self.buckets = shard_buckets(self.plan, self.bucket_bytes)
            ranks = [(self.rank_offsets[f.engine_id] + rp.rank, rp)
                     for f, rank_plans in zip(self.fleet, self.plan.ranks, strict=True) for rp in rank_plans]
            self.schedules = [bucket_schedules(b, ranks, self.num_senders) for b in self.buckets]
        self.generation += 1
        self.group_name = f"{self.group_base}_{self.generation}"
        # Group rank 0 hosts the rendezvous: this process (full) or trainer TP rank 0 (shard), whose node
        # picks the port and tells the address the engines dial.
        if self.mode == "full":
            assert self.master_address is not None
            address, port = self.master_address, free_port("")
        else:
            assert self.senders is not None
            address, port = self.senders.weight_group_endpoint()
        self.endpoint = (address, port)
        if self.mode == "full":
            futures = {f.engine_id: self.loop.submit(f.engine.init_weights_update_group(
                address, port, self.rank_offsets[f.engine_id], world, self.group_name, self.backend))
                for f in self.fleet}
        else:
            futures = self._post({f.engine_id: self._loader_call(f, [join_request(
                self.group_name, self.backend, address, port, self.rank_offsets[f.engine_id] + r, world,
                self.init_timeout_s, rank_params(self.specs, f.spec, r)) for r in range(f.spec.tp)], None, False)
                for f in self.fleet})
        try:
            if self.mode == "full":
                self._formed = form_group(self.backend, address, port, 0, world, self.group_name,
                                          self.init_timeout_s, key=self._group_key,
                                          warm_up=WarmUp() if self.engine_warm_up else None)
                self.group = self._formed.group
            else:
                assert self.senders is not None
                self.senders_joined = True  # some ranks may have joined even if others failed
                self.senders.join_weight_group(address, port, world, self.group_name, self.backend,
                                               self.init_timeout_s, self._group_key)
        except Exception as exc:  # the rendezvous timed out or broke: report which engines never answered
            self.state = TransportState.FAILED
            pending = sorted(eid for eid, fut in futures.items() if not fut.done())
            raise WeightSyncError(f"weight-update group {self.group_name} (world {world}) did not form: {exc!r}; "
                                  f"engines still joining: {pending}") from exc
        try:
            self.loop.gather(futures)
        except WeightSyncError:
            self.state = TransportState.FAILED
            self._close_rendezvous()  # no push will follow on this group: its store has nothing left to do
            raise
        self.state = TransportState.CONNECTED

    def close(self) -> None:
        """Destroy the group here, on the senders and on every engine (idempotent)."""
        self._teardown()
        self.state = TransportState.CLOSED

    @property
    def rendezvous_open(self) -> bool:
        """This process still hosts the group's store (full mode with SGLang's join, before the first push)."""
        return self._formed is not None and self._formed.rendezvous is not None

    def _close_rendezvous(self) -> None:
        if self._formed is not None:
            self._formed.close_rendezvous()

    def _teardown(self) -> None:
        self._close_rendezvous()
        self._formed = None
        if self.group is None and not self.senders_joined:
            return
        if self.mode == "full":
            futures = {f.engine_id: self.loop.submit(f.engine.destroy_weights_update_group(self.group_name))
                       for f in self.fleet}
        else:
            futures = self._post({f.engine_id: self._loader_call(f, [leave_request(self.group_name)] * f.spec.tp,
                                                                 None, False) for f in self.fleet})
        if self.group is not None:
            dist.destroy_process_group(self.group)
            self.group = None
        if self.senders_joined and self.senders is not None:
            self.senders_joined = False
            self.senders.leave_weight_group()
        for fut in futures.values():
            # A dead engine cannot leave the group; its replacement joins the next one.
            fut.exception(self.loop.timeout_s)

    # ---- push -----------------------------------------------------------------------------------

    def push(self, named_shards: ShardSource, version: str) -> PushReport:
        """Send every bucket to every engine; the last bucket flushes the engines' caches.

        `named_shards` feeds the full mode only; in shard mode the trainer ranks send from their
        live parameters and nothing is gathered here.
        """
        self._require(TransportState.CONNECTED)
        version = str(version)
        report = PushReport(version, f"{self.name}/{self.mode}", tuple(f.engine_id for f in self.fleet))
        report.buckets = len(self.buckets)
        try:
            if self.mode == "full":
                shards = resolve_shards(named_shards, report, self.num_senders)
            for bucket in self.buckets:
                last = bucket.index == len(self.buckets) - 1
                if self.mode == "full":
                    self._push_full(bucket, shards, version, last, report)
                else:
                    self._push_shard(bucket, version, last, report)
        except Exception:
            self.state = TransportState.FAILED
            self._abandon()
            raise
        return report

    def _abandon(self) -> None:
        """Tear the group down after a failed push, here and on the engines.

        Engines still waiting for the push's data would wait out the group timeout with their model
        thread blocked, failing the health checks that follow the failure: closing the senders' side
        ends their wait at once. `connect` builds the next group.
        """
        try:
            self._teardown()
        except Exception as exc:  # an engine that cannot answer its leave request is found by health checks
            logger.warning("weight-update group %s: teardown after a failed push: %r", self.group_name, exc)

    def _post(self, bucket_calls: dict[str, Any]) -> dict[str, Future[Any]]:
        return {eid: self.loop.submit(call) for eid, call in bucket_calls.items()}

    @staticmethod
    def _loader_call(f: FleetEngine, requests: Sequence[LoaderRequest], version: str | None, flush: bool) -> Any:
        """The engine's weight-loader plugin runs `requests[r]` in its TP rank r."""
        return f.engine.update_weights_from_tensor([serialize(r) for r in requests], LOADER_FUNCTION, version,
                                                   flush_cache=flush)

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
        # Every engine answered, so it received the broadcast: its communicator exists, the store is done.
        self._close_rendezvous()
        report.bytes += sum(t.numel() * t.element_size() for t in tensors.values())

    def _push_shard(self, bucket: Bucket, version: str, last: bool, report: PushReport) -> None:
        assert self.plan is not None and self.senders is not None
        specs = {s.name: s for s in self.specs}
        futures = self._post({f.engine_id: self._loader_call(
            f, [receive_request(self.group_name, bucket, rp, specs, f.spec) for rp in rank_plans], version, last)
            for f, rank_plans in zip(self.fleet, self.plan.ranks, strict=True)})
        try:
            with report.phase("transfer"):
                stats = self.senders.send_weight_bucket(self.schedules[bucket.index])
        except Exception as exc:
            # The engines wait for data that will not come: `push` tears the group down, which ends
            # their wait; their answers are not awaited here.
            raise WeightSyncError(f"trainer ranks failed to send bucket {bucket.index}: {exc!r}") from exc
        # The senders slice and cast inside their send call: that share of it is reported as convert.
        convert = max(s.convert_s for s in stats)
        report.seconds["convert"] += convert
        report.seconds["transfer"] -= convert
        with report.phase("load"):
            self.loop.gather(futures)
        report.bytes += sum(s.bytes for s in stats)

