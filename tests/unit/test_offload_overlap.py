"""An optimizer offload overlapping a weight push: the trainer's deferred offload (LEAVING until settled, on a CPU
build the same bookkeeping), the order the hand-off runs it in around a push, and where the push lets it finish."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from fake_rollout_engine import FakeEngine, TensorTransport
from handoff_fakes import handoff_of

from miles_lite.config.compose import load_config
from miles_lite.config.schema import FaultToleranceConfig
from miles_lite.rollout.fleet import EngineFleet, EngineHandle
from miles_lite.rollout.sync_api import EventLoopThread
from miles_lite.run.handoff import overlap_room
from miles_lite.trainer import offload as offload_module
from miles_lite.trainer.offload import (
    OVERLAP_MARGIN,
    OVERLAP_SLACK_BYTES,
    OverlapRoom,
    PartState,
    TrainerOffload,
)
from miles_lite.weight_sync.coordinator import WeightSyncCoordinator
from miles_lite.weight_sync.fleet_push import FleetPusher
from miles_lite.weight_sync.transport import EngineLoop

S = PartState


class _Trainer:
    """Parameters, gradient buffers and optimizer state as plain tensors (fp32 main copies, two Adam moments,
    one moment a view into a larger storage), with random values."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.params = [torch.randn(64, 32, generator=g).to(torch.bfloat16), torch.randn(32, generator=g)]
        self.grads = [torch.randn(64 * 32 + 32, generator=g)]
        flat = torch.randn(4096, generator=g)
        self.opt = [p.float().clone() for p in self.params] + [flat[:2048].view(64, 32), flat[2048:2080],
                                                               torch.randn(64, 32, generator=g)]
        self.offload = TrainerOffload({"params": lambda: self.params, "grads": lambda: self.grads,
                                       "optimizer": lambda: self.opt})

    def snapshot(self) -> list[torch.Tensor]:
        return [t.clone() for t in (*self.params, *self.opt)]

    def exact(self, before: list[torch.Tensor]) -> bool:
        now = [*self.params, *self.opt]
        return len(now) == len(before) and all(a.dtype == b.dtype and torch.equal(a, b)
                                               for a, b in zip(before, now, strict=True))


def _bytes(tensors: list[torch.Tensor]) -> int:
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def test_a_deferred_offload_leaves_then_settles_and_round_trips_exactly() -> None:
    t = _Trainer()
    before, sizes = t.snapshot(), {"grads": _bytes(t.grads), "optimizer": _bytes(t.opt)}
    moved = t.offload.offload(("grads", "optimizer"), wait=False)
    # The gradients are dropped at once; the optimizer state is copied but its storage is still held.
    assert moved.deferred is True and moved.bytes == sizes
    assert t.offload.states == {"params": S.RESIDENT, "grads": S.OFFLOADED, "optimizer": S.LEAVING}
    assert all(g.untyped_storage().nbytes() == 0 for g in t.grads)
    assert all(o.untyped_storage().nbytes() > 0 for o in t.opt)
    assert t.offload.offloaded() == {"grads", "optimizer"}
    assert moved.report()["deferred"] == 1.0
    assert t.offload.settle() >= 0.0
    assert t.offload.states["optimizer"] is S.OFFLOADED
    assert all(o.untyped_storage().nbytes() == 0 for o in t.opt)
    assert t.offload.settle() >= 0.0 and t.offload.states["optimizer"] is S.OFFLOADED  # a no-op now
    back = t.offload.onload(("grads", "optimizer"))
    assert back.bytes == moved.bytes and back.deferred is None
    assert set(t.offload.states.values()) == {S.RESIDENT}
    assert t.exact(before)
    assert all(not g.count_nonzero() for g in t.grads)  # dropped: back as the zeros a step starts from


def test_a_waiting_offload_reports_no_deferral_and_goes_straight_to_offloaded() -> None:
    t = _Trainer()
    moved = t.offload.offload(("grads", "optimizer"))
    assert moved.deferred is None and "deferred" not in moved.report()
    assert t.offload.states == {"params": S.RESIDENT, "grads": S.OFFLOADED, "optimizer": S.OFFLOADED}


def test_an_onload_of_a_leaving_part_settles_it_first() -> None:
    t = _Trainer()
    before = t.snapshot()
    t.offload.offload(("optimizer",), wait=False)
    assert t.offload.states["optimizer"] is S.LEAVING
    back = t.offload.onload(("optimizer",))
    assert back.bytes == {"optimizer": _bytes(t.opt)}  # moved back: it had left
    assert t.offload.states["optimizer"] is S.RESIDENT and not t.offload._leaving
    assert t.exact(before)


@pytest.mark.parametrize("reader", ["require_resident", "ready_on_device", "check_resident"])
def test_a_reader_of_a_leaving_part_settles_it_and_is_refused(reader: str) -> None:
    t = _Trainer()
    t.offload.offload(("grads", "optimizer"), wait=False)
    # A reader of another part leaves the optimizer leaving.
    getattr(t.offload, reader)(("params",), "reading the weights")
    assert t.offload.states["optimizer"] is S.LEAVING
    with pytest.raises(RuntimeError, match="an optimizer step needs the trainer's optimizer.*onload them first"):
        getattr(t.offload, reader)(("optimizer",), "an optimizer step")
    assert t.offload.states["optimizer"] is S.OFFLOADED
    assert all(o.untyped_storage().nbytes() == 0 for o in t.opt)


def test_resident_bytes_and_another_offload_settle_a_leaving_part() -> None:
    t = _Trainer()
    t.offload.offload(("grads", "optimizer"), wait=False)
    assert t.offload.resident_bytes() == _bytes(t.params)
    assert t.offload.states["optimizer"] is S.OFFLOADED

    t = _Trainer()
    before, params = t.snapshot(), _bytes(t.params)
    t.offload.offload(("grads", "optimizer"), wait=False)
    again = t.offload.offload(("params", "grads", "optimizer"))
    assert again.bytes == {"params": params}  # the optimizer settled, not moved twice
    assert t.offload.states == dict.fromkeys(("params", "grads", "optimizer"), S.OFFLOADED)
    t.offload.onload()
    assert t.exact(before)


def test_a_staged_part_stays_readable_and_its_offload_takes_the_copies_made_then() -> None:
    t = _Trainer()
    before, params = t.snapshot(), _bytes(t.params)
    staged = t.offload.stage(("params", "grads"))
    assert staged.bytes == {"params": params}  # gradients are dropped, never copied
    assert t.offload.states["params"] is S.RESIDENT and t.offload.offloaded() == frozenset()
    t.offload.require_resident(("params",), "reading the weights")  # a reader keeps the copies
    assert t.offload.stage(("params",)).bytes == {}  # staged once
    # Written behind the offloader's back, the values the offload keeps are the staged ones: it made no copy.
    t.params[0].add_(1)
    moved = t.offload.offload(("params",))
    assert moved.bytes == {"params": params} and t.offload.states["params"] is S.OFFLOADED
    t.offload.onload(("params",))
    assert t.exact(before)


def _step_writes(t: _Trainer) -> None:
    t.offload.ready_on_device(("params", "grads"), "an optimizer step")  # drops what was staged
    t.params[0].add_(1)


def _new_storage(t: _Trainer) -> None:
    t.params[1] = t.params[1].clone().add_(1)  # a new storage under the part


@pytest.mark.parametrize("change", [_step_writes, _new_storage], ids=["optimizer-step", "new-storage"])
def test_a_staged_part_written_or_replaced_since_is_copied_anew(change: Callable[[_Trainer], None]) -> None:
    t = _Trainer()
    t.offload.stage(("params",))
    change(t)
    after = t.snapshot()
    t.offload.offload(("params",))
    t.offload.onload(("params",))
    assert t.exact(after)


def test_a_deferred_offload_of_a_staged_part_leaves_on_its_copies_and_round_trips() -> None:
    t = _Trainer()
    before = t.snapshot()
    t.offload.stage(("params",))
    moved = t.offload.offload(("params", "optimizer"), wait=False)
    assert moved.deferred is True and t.offload.states["params"] is S.LEAVING
    t.offload.settle()
    assert all(p.untyped_storage().nbytes() == 0 for p in t.params)
    t.offload.onload()
    assert t.exact(before)


def test_without_room_a_deferred_offload_completes_before_it_returns(monkeypatch) -> None:
    asked: list[int] = []

    def no_room(moved: Any, keep_free: int) -> bool:
        asked.append(keep_free)
        return False

    monkeypatch.setattr(offload_module, "_room", no_room)
    t = _Trainer()
    before = t.snapshot()
    moved = t.offload.offload(("grads", "optimizer"), wait=False, keep_free=123)
    assert asked == [123] and moved.deferred is False and moved.report()["deferred"] == 0.0
    assert t.offload.states["optimizer"] is S.OFFLOADED and not t.offload._leaving
    assert all(o.untyped_storage().nbytes() == 0 for o in t.opt)
    t.offload.onload()
    assert t.exact(before)


def test_the_room_rule() -> None:
    room = OverlapRoom(weights_scale=2.0, staging_bytes=10)
    assert room.bytes_needed(1000) == int(2000 * OVERLAP_MARGIN) + 10 + OVERLAP_SLACK_BYTES
    # One engine a device, each holding the whole model the one trainer rank holds: the rank's parameters.
    one = overlap_room(load_config(["cluster.placement=colocated", "rollout.engines=1"]), weights_resumed=True)
    assert one == OverlapRoom(1.0, 2 * 512 << 20)
    # Two engines on the one device (the default fleet), and none resumed where they keep their weights.
    assert overlap_room(load_config(["cluster.placement=colocated"]), True).weights_scale == 2.0
    assert overlap_room(load_config(["cluster.placement=colocated"]), False).weights_scale == 0.0
    # One engine of tp=2 beside a one-rank trainer: half the model on the trainer's device.
    assert overlap_room(load_config(["cluster.placement=colocated", "rollout.engines=1", "rollout.engine_tp=2"]),
                        True).weights_scale == 0.5
    # Trainer tp=2 x dp=2 (4 devices), two engines of tp=2 started on devices 0 and 1: device 1 may hold a rank of
    # each, two halves of the model, twice a trainer rank's half.
    cfg = load_config(["cluster.placement=colocated", "trainer.tp=2", "trainer.dp=2", "rollout.engines=2",
                       "rollout.engine_tp=2", "weight_sync.bucket_mib=64"])
    assert overlap_room(cfg, True) == OverlapRoom(2.0, 2 * 64 << 20)
    # Eight engines of tp=1 over those four devices: two on each.
    cfg = load_config(["cluster.placement=colocated", "trainer.tp=2", "trainer.dp=2", "rollout.engines=8"])
    assert overlap_room(cfg, True).weights_scale == 2 * 2


# ---- the hand-off's order around a push -----------------------------------------------------------------


def test_with_room_the_optimizer_offload_overlaps_the_push_until_the_kv_cache_wakes() -> None:
    handoff, log, trainer = handoff_of(room=True)
    report, seconds = handoff.push(3)
    assert report.phases == {"load": 0.5} and seconds == 1.0
    # The gradients are freed before any copy is queued (freeing device memory waits for every stream's work), and
    # the probe's trainer scores are taken before any too: their read-back would wait behind the offload's copies.
    # The optimizer state's copies are queued before the parameters': the KV cache's wake waits for those alone.
    assert log == ["engines sleep", "onload", "offload grads", "score probe 3", "stage optimizer", "stage params",
                   "offload optimizer (in flight)", "wake weights", "load", "settle", "wake kv cache", "offload params"]
    assert trainer.rooms == [None, handoff.room, None] and handoff.room.weights_scale == 2.0
    stats = handoff.stats()
    assert stats["time/offload_seconds"] == 0.25 + 2 * 0.0625 + 0.25 + 0.5 + 0.25  # the staging, the settle's wait
    assert stats["time/offload_overlapped"] == 1.0 and stats["time/engine_wake_seconds"] == 0.125
    assert "time/offload_overlapped" not in handoff.stats()  # reset with the step


def test_without_room_the_optimizer_leaves_before_the_push() -> None:
    handoff, log, _ = handoff_of(room=False)
    handoff.push(3)
    assert log == ["engines sleep", "onload", "offload grads", "score probe 3", "stage optimizer", "stage params",
                   "offload optimizer", "wake weights", "load", "wake kv cache", "offload params"]
    stats = handoff.stats()
    assert stats["time/offload_seconds"] == 0.875 and stats["time/offload_overlapped"] == 0.0


def test_the_push_prepared_before_a_checkpoint_scores_and_stages_nothing_again() -> None:
    """The driver prepares the push once the optimizer step is done and before a checkpoint (which writes the
    staged copies); the push then only takes them. A push for another version prepares anew."""
    handoff, log, _ = handoff_of(room=True)
    handoff.prepare_push(3)
    assert log == ["engines sleep", "onload", "offload grads", "score probe 3", "stage optimizer", "stage params"]
    log.clear()
    handoff.push(3)
    assert log == ["offload optimizer (in flight)", "wake weights", "load", "settle", "wake kv cache",
                   "offload params"]
    handoff.prepare_push(4)
    log.clear()
    handoff.push(5)  # not what was prepared: the trainer's probe scores were for version 4
    assert log[:4] == ["offload grads", "score probe 5", "stage optimizer", "stage params"]


def test_a_push_that_fails_before_the_kv_wake_still_settles_the_offload() -> None:
    handoff, log, _ = handoff_of(room=True, fail=True)
    with pytest.raises(RuntimeError, match="refused the load"):
        handoff.push(3)
    assert log[-3:] == ["wake weights", "load", "settle"] and log.count("settle") == 1


# ---- where the fleet's push calls it ------------------------------------------------------------------


def test_the_fleet_push_calls_before_wake_after_the_load_and_before_the_kv_cache_resumes() -> None:
    ft = FaultToleranceConfig(health_interval_s=0.05, health_timeout_s=0.2, failure_threshold=1,
                              max_engine_restarts=2, request_retries=3)
    with EventLoopThread() as thread:
        loop = EngineLoop(thread.loop, timeout_s=10.0)
        a = FakeEngine("a")

        async def fleet_of_a() -> EngineFleet:
            fleet = EngineFleet(ft, None)
            await fleet.add_engine(EngineHandle(a))
            return fleet

        fleet = loop.run(fleet_of_a())
        pusher = FleetPusher(WeightSyncCoordinator(TensorTransport(loop), loop), fleet, loop, 1, "reference")
        try:
            loop.run(fleet.sleep())
            pusher.push({}, "1", before_wake=lambda: a.log.append("before wake"))
            assert a.log == ["release weights,kv_cache,cuda_graph", "resume weights", "update_weights",
                             "before wake", "resume kv_cache,cuda_graph"]
        finally:
            loop.run(fleet.close())


# ---- a Ray gang: each rank decides and settles for itself -------------------------------------------------


class _Remote:
    def __init__(self, fn: Callable[..., Any]) -> None:
        self.remote = fn


class _Rank:
    def __init__(self, rank: int, room: bool, log: list[str]) -> None:
        def offload(parts: tuple[str, ...], room_asked: OverlapRoom | None = None) -> dict[str, float]:
            log.append(f"rank {rank} offload")
            out = {"optimizer_bytes": float(100 + rank), "seconds": 0.1 * (rank + 1)}
            return out if room_asked is None else {**out, "deferred": float(room)}

        def finish_offload() -> dict[str, float]:
            log.append(f"rank {rank} settle")
            return {"seconds": 0.5 + rank}

        self.offload, self.finish_offload = _Remote(offload), _Remote(finish_offload)


def test_a_ray_gang_defers_when_any_rank_did_and_every_rank_settles_its_own(monkeypatch) -> None:
    from miles_lite.cluster.ray_trainer import GroupState, RayTrainerGroup

    log: list[str] = []
    group = object.__new__(RayTrainerGroup)
    group.state, group.actors = GroupState.READY, [_Rank(0, False, log), _Rank(1, True, log)]
    # The answers stand in for their object refs.
    monkeypatch.setattr(group, "_collect", lambda refs, what, timeout_s=None: [refs[r] for r in sorted(refs)])
    room = OverlapRoom(1.0, 0)
    assert group.offload(("grads", "optimizer"), room) == {"optimizer_bytes": 100.0, "seconds": 0.1, "deferred": 1.0}
    assert group.offload(("grads", "optimizer")) == {"optimizer_bytes": 100.0, "seconds": 0.1}
    assert group.finish_offload() == {"seconds": 0.5}
    assert log == ["rank 0 offload", "rank 1 offload"] * 2 + ["rank 0 settle", "rank 1 settle"]
    group.actors = [_Rank(0, False, log), _Rank(1, False, log)]
    assert group.offload(("optimizer",), room)["deferred"] == 0.0
