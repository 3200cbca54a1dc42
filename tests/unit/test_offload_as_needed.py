"""`trainer.offload.when=needed`: a hand-off moves the trainer's parameters and optimizer state off the device only
as far as the engines need the room when they wake (what they freed going to sleep, plus a spare share)."""

from __future__ import annotations

import logging

import pytest
import torch
from handoff_fakes import GIB, FakeDevice, handoff_of

from miles_lite.config.colocation import saves_staged_copies
from miles_lite.config.compose import load_config
from miles_lite.run.handoff import SPARE_FRACTION, Holder, parts_leaving
from miles_lite.trainer import offload as offload_module
from miles_lite.trainer.offload import TrainerOffload

NEEDED = ("trainer.offload.when=needed",)
KEPT = ("params", "optimizer")


def _rank(free: float, total: float = 80.0, params: float = 2.0, optimizer: float = 4.0) -> dict[str, float]:
    return {"free_bytes": free * GIB, "total_bytes": total * GIB, "params_bytes": params * GIB,
            "optimizer_bytes": optimizer * GIB}


def test_the_rule_moves_the_optimizer_first_then_the_parameters_as_far_as_the_engines_need() -> None:
    spare = SPARE_FRACTION * 80.0  # 10 GiB of the 80 stay free beside the engines
    assert parts_leaving(KEPT, [_rank(free=30.0 + spare)], [30.0 * GIB]) == ()
    assert parts_leaving(KEPT, [_rank(free=30.0 + spare - 1.0)], [30.0 * GIB]) == ("optimizer",)
    assert parts_leaving(KEPT, [_rank(free=30.0 + spare - 4.5)], [30.0 * GIB]) == KEPT
    # Short by more than both hold: both leave (the engines get what there is).
    assert parts_leaving(KEPT, [_rank(free=1.0)], [30.0 * GIB]) == KEPT
    # Only the configured parts are ever moved.
    assert parts_leaving(("params",), [_rank(free=1.0)], [30.0 * GIB]) == ("params",)
    # One plan for the gang: what the tightest rank needs moved.
    assert parts_leaving(KEPT, [_rank(free=60.0), _rank(free=39.0)], [30.0 * GIB, 30.0 * GIB]) == ("optimizer",)
    # Nothing measured (the engines never seen asleep, a CPU rank, a rank count that changed): all leave.
    assert parts_leaving(KEPT, [_rank(free=70.0)], None) == KEPT
    assert parts_leaving(KEPT, [{}], [0.0]) == KEPT
    assert parts_leaving(KEPT, [_rank(free=70.0)] * 2, [0.0]) == KEPT


def test_on_a_device_with_room_nothing_is_copied_and_the_state_stays_while_the_engines_generate(caplog) -> None:
    """0.5B-like: the engines take 30 of 80 GiB, the trainer's state 6: after the first step's sleep measured the
    engines, the push stages and offloads nothing but the gradients, and the engines wake with room to spare.
    Their weights start resuming as soon as the plan is made (the room is free then), ahead of the trainer's probe
    scoring and any checkpoint; the push waits for that resume rather than asking for it."""
    device = FakeDevice(total=80.0, engines=30.0, parts={"params": 2.0, "optimizer": 4.0})
    handoff, log, _ = handoff_of(room=True, overrides=NEEDED, device=device)
    with caplog.at_level(logging.INFO, logger="miles_lite.run.handoff"):
        report, _ = handoff.push(1)
    assert log == ["engines sleep", "onload", "offload grads", "wake weights (early)", "score probe 1", "load",
                   "wake kv cache"]
    assert "wake_weights" in report.phases  # the push's wait for the early resume
    assert device.resident == {"params", "optimizer"} and device.awake
    assert handoff.system.pusher.free_at_wake == 80.0 - 2.0 - 6.0 - 30.0
    assert "params, optimizer stay on the device" in caplog.text and "the engines take 30.0 GiB" in caplog.text
    stats = handoff.stats()
    assert stats["time/offload_seconds"] == 0.25 and "time/offload_overlapped" not in stats
    # The next step: the state never left, so only the gradients come back; the plan is the same, logged once.
    caplog.clear()
    log.clear()
    handoff.for_generation()
    with caplog.at_level(logging.INFO, logger="miles_lite.run.handoff"):
        handoff.push(2)
    assert log == ["engines sleep", "onload", "offload grads", "wake weights (early)", "score probe 2", "load",
                   "wake kv cache"]
    assert "stay on the device" not in caplog.text


def test_the_engines_go_to_sleep_before_the_rewards_and_training_waits_for_that_sleep() -> None:
    """`sleep_engines` (the driver calls it once generation and evaluation are done) starts the sleep on the rollout
    loop; the rewards are scored meanwhile; `for_training` waits for that sleep rather than asking for another,
    and the engines' share is still measured across it (the memory read before it began)."""
    device = FakeDevice(total=80.0, engines=30.0, parts={"params": 2.0, "optimizer": 4.0})
    handoff, log, _ = handoff_of(room=True, overrides=NEEDED, device=device)
    handoff.sleep_engines()
    assert log == ["engines sleep"] and handoff.holder is Holder.HANDING_OVER and not device.awake
    log.append("score rewards")
    with pytest.raises(RuntimeError, match="only a weight push"):
        handoff.for_generation()
    handoff.sleep_engines()  # already going to sleep: nothing more
    handoff.for_training()
    assert log == ["engines sleep", "score rewards", "onload"] and handoff.holder is Holder.TRAINER
    assert "time/engine_sleep_seconds" in handoff.stats()
    handoff.push(1)  # measured: the state stays and the engines' weights resume early
    assert log[-5:] == ["offload grads", "wake weights (early)", "score probe 1", "load", "wake kv cache"]


def test_where_the_engines_need_more_the_optimizer_leaves_and_the_parameters_stay() -> None:
    """7B-like: the engines take 60 GiB; the optimizer state (12) leaving makes room, the parameters (4) stay."""
    device = FakeDevice(total=80.0, engines=60.0, parts={"params": 4.0, "optimizer": 12.0})
    handoff, log, _ = handoff_of(room=False, overrides=NEEDED, device=device)
    handoff.push(1)
    assert log == ["engines sleep", "onload", "offload grads", "score probe 1", "stage optimizer",
                   "offload optimizer", "wake weights", "load", "wake kv cache"]
    assert device.resident == {"params"}
    assert handoff.system.pusher.free_at_wake >= SPARE_FRACTION * 80.0


def test_where_the_engines_need_it_all_everything_leaves_as_always() -> None:
    device = FakeDevice(total=80.0, engines=70.0, parts={"params": 4.0, "optimizer": 12.0})
    handoff, log, _ = handoff_of(room=False, overrides=NEEDED, device=device)
    handoff.push(1)
    assert log[2:] == ["offload grads", "score probe 1", "stage optimizer", "stage params", "offload optimizer",
                       "wake weights", "load", "wake kv cache", "offload params"]
    assert device.resident == set()


def test_always_moves_everything_and_measures_nothing() -> None:
    device = FakeDevice(total=80.0, engines=30.0, parts={"params": 2.0, "optimizer": 4.0})
    handoff, log, trainer = handoff_of(room=False, device=device)
    trainer.device_memory = None  # never asked
    handoff.push(1)
    assert "offload params" in log and device.resident == set()


def test_a_step_some_engines_missed_never_lowers_what_the_engines_take_back() -> None:
    device = FakeDevice(total=80.0, engines=60.0, parts={"params": 4.0, "optimizer": 12.0})
    handoff, log, _ = handoff_of(room=False, overrides=NEEDED, device=device)
    handoff.push(1)
    handoff.for_generation()
    device.engines = 5.0  # an engine died before this step's sleep: the sleep frees little
    log.clear()
    handoff.push(2)
    assert "offload optimizer" in log and device.resident == {"params"}


def test_a_step_that_saves_stages_what_stays_and_the_push_drops_those_copies() -> None:
    """On a step that saves a checkpoint, what stays on the device is staged (after the probe, on the offload's
    stream on a GPU) so the save writes those copies rather than queueing its own on the compute stream ahead of
    the push; the push drops them (no offload takes them). A step without a save stages nothing."""
    device = FakeDevice(total=80.0, engines=30.0, parts={"params": 2.0, "optimizer": 4.0})
    handoff, log, _ = handoff_of(room=True, overrides=NEEDED, device=device)
    handoff.push(1)  # the first push measures the engines
    handoff.for_generation()
    log.clear()
    handoff.prepare_push(2, saving=True)
    assert log == ["engines sleep", "onload", "offload grads", "wake weights (early)", "score probe 2",
                   "stage params,optimizer"]
    handoff.push(2)
    assert log[-3:] == ["load", "wake kv cache", "unstage params,optimizer"]
    assert device.resident == {"params", "optimizer"}
    handoff.for_generation()
    log.clear()
    handoff.prepare_push(3)
    handoff.push(3)
    assert not any(entry.startswith(("stage", "unstage")) for entry in log)


def test_a_run_keeping_its_state_saves_the_staged_copies_too() -> None:
    """Every step that saves stages all that a checkpoint holds, so neither run reserves snapshot buffers."""
    always = load_config(["cluster.placement=colocated"])
    needed = load_config(["cluster.placement=colocated", *NEEDED])
    assert saves_staged_copies(always.cluster, always.trainer.offload)
    assert saves_staged_copies(needed.cluster, needed.trainer.offload)


def test_a_rank_reads_its_device_and_the_parts_it_holds(monkeypatch) -> None:
    params, opt = [torch.zeros(256)], [torch.zeros(512), torch.zeros(64)]
    offload = TrainerOffload({"params": lambda: params, "grads": lambda: [], "optimizer": lambda: opt})
    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (30 * 2**30, 80 * 2**30))
    cuda = torch.device("cuda", 0)
    assert offload_module.device_memory(offload, cuda, parts=False) == {"free_bytes": 30.0 * GIB,
                                                                         "total_bytes": 80.0 * GIB}
    assert calls == []
    assert offload_module.device_memory(offload, cuda, parts=True) == {
        "free_bytes": 30.0 * GIB, "total_bytes": 80.0 * GIB, "params_bytes": 1024.0, "optimizer_bytes": 2304.0}
    assert calls == ["empty_cache"]  # the trainer's cached blocks are the engines' to take
    assert offload_module.device_memory(offload, torch.device("cpu"), parts=True) == {}


def test_the_setting_is_checked() -> None:
    from miles_lite.config.validate import ConfigError, validate

    with pytest.raises(ConfigError, match=r"trainer.offload.when='sometimes' is not one of always, needed"):
        validate(load_config(["trainer.offload.when=sometimes"]))
