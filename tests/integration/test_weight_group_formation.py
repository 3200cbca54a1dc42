"""The weight-update group's store listens only while the group forms, through a real fleet: trainer TP ranks in
their own processes (shard mode) and a reference engine, gloo on CPU, with the run's key.

While an engine's join is held back, the rendezvous port accepts connections (the group is forming); once the
push's `connect` returned, a connection to it is refused, and pushes through the formed group still land bit
for bit. An engine restarted and re-admitted (a new incarnation) makes a new world: the new group's store
listens while it forms and is closed after. Full mode: closed at formation, or after the first broadcast where
the engines join as SGLang's own group join does (no warm-up on their side).
"""

from __future__ import annotations

import asyncio
import errno
import socket
import threading
import time
from typing import Any

import pytest
from shard_senders import ProcessSenders
from test_weight_sync_reference import SHAPE, VOCAB, Trainer, make_verifier
from test_weight_sync_tp import assert_serves, layouts_for

from miles_lite.config.schema import RolloutConfig
from miles_lite.engines.launcher import EngineLauncher
from miles_lite.net.api_key import ApiKey, new_key
from miles_lite.net.ports import LOCAL_HOST
from miles_lite.rollout.sync_api import EventLoopThread
from miles_lite.trainer.model import spec_from_hf_config
from miles_lite.trainer.tiny_hf import make_tiny_hf_model
from miles_lite.weight_sync.buckets import MIB
from miles_lite.weight_sync.coordinator import WeightSyncCoordinator
from miles_lite.weight_sync.distributed import DistributedTransport
from miles_lite.weight_sync.layouts import specs_from_layouts
from miles_lite.weight_sync.loader_protocol import deserialize, from_named_tensors
from miles_lite.weight_sync.plan import EngineSpec
from miles_lite.weight_sync.transport import EngineLoop, FleetEngine

pytestmark = pytest.mark.slow
TRAINER_TP = 2
FORMATION_WAIT_S = 120.0


class HeldJoin:
    """An engine client whose next join request waits for `release` (the group cannot form before it)."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.armed = False
        self.reached = threading.Event()
        self.released = threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)

    async def update_weights_from_tensor(self, payloads: list[str], load_format: str | None, version: str | None,
                                         flush_cache: bool = True) -> None:
        if self.armed and from_named_tensors(deserialize(payloads[0])).op == "join":
            self.armed = False
            self.reached.set()
            await asyncio.to_thread(self.released.wait, FORMATION_WAIT_S)
        await self.client.update_weights_from_tensor(payloads, load_format, version, flush_cache)


class RecordedEndpoint:
    """The trainer ranks, recording every rendezvous endpoint the transport asks them for."""

    def __init__(self, senders: ProcessSenders) -> None:
        self.senders = senders
        self.endpoints: list[tuple[str, int]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.senders, name)

    def weight_group_endpoint(self) -> tuple[str, int]:
        endpoint = self.senders.weight_group_endpoint()
        self.endpoints.append(endpoint)
        return endpoint


def connect_errno(port: int) -> int:
    """0 when something accepts a TCP connection on the loopback port, else the connect's errno."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        return sock.connect_ex((LOCAL_HOST, port))


def push_while_watching(sync: WeightSyncCoordinator, fleet: list[FleetEngine], held: HeldJoin,
                        senders: RecordedEndpoint, trainer: Trainer, old: Trainer, version: str) -> int:
    """Push with `held`'s join held back; assert the store listens while the group forms. The group's port."""
    held.armed = True
    known = len(senders.endpoints)
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["report"] = sync.push(fleet, lambda: pytest.fail("shard mode gathers nothing"), version)
        except BaseException as exc:  # reported below
            result["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    try:
        assert held.reached.wait(FORMATION_WAIT_S), "the engine's join request never came"
        assert len(senders.endpoints) == known + 1
        port = senders.endpoints[-1][1]
        # The trainer ranks are joining (rank 0 hosts the store) while the engine is held back.
        deadline = time.monotonic() + FORMATION_WAIT_S
        while connect_errno(port) != 0:
            assert time.monotonic() < deadline and thread.is_alive(), f"the store never listened on {port}"
            time.sleep(0.05)
        assert thread.is_alive()  # the group has not formed: the listening store belongs to the formation
    finally:
        held.reached.clear()
        held.released.set()
        thread.join(FORMATION_WAIT_S * 2)
        held.released.clear()
    assert not thread.is_alive(), "the push did not finish"
    if "error" in result:
        raise result["error"]
    report = result["report"]
    assert report.verify is not None and report.verify.logp_diff_mean < 1e-6
    return port


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("wgroup")
    # The run's key: the engine reads its file (and its group ranks present it), the trainer ranks get it from
    # the transport.
    (root / "keys").mkdir()
    key = ApiKey.private(new_key(), parent=str(root / "keys"))
    model_dir = make_tiny_hf_model("qwen2", SHAPE, VOCAB, root / "init", seed=0)
    spec = spec_from_hf_config(model_dir)
    loop_thread = EventLoopThread("wgroup-test").start()
    launcher = EngineLauncher(RolloutConfig(backend="reference", engines=1, startup_timeout_s=180),
                              str(model_dir), str(root / "logs"), api_key=key)
    senders = ProcessSenders(TRAINER_TP)
    state = {"handle": loop_thread.run(launcher.start(0))}
    try:
        yield dict(spec=spec, key=key.value, loop=EngineLoop(loop_thread.loop, 120), launcher=launcher,
                   loop_thread=loop_thread, senders=senders, state=state, layouts=layouts_for(spec, TRAINER_TP))
    finally:
        senders.close()
        loop_thread.run(launcher.stop(state["handle"]))
        loop_thread.stop()
        key.close()


def test_store_listens_only_while_the_group_forms_and_again_after_an_engine_restart(world):
    layouts = world["layouts"]
    trainers = [Trainer(seed, world["spec"], layouts) for seed in (0, 21, 22, 23)]
    senders = RecordedEndpoint(world["senders"])
    transport = DistributedTransport(specs_from_layouts(layouts[0].values(), "float32"), TRAINER_TP, world["loop"],
                                     bucket_bytes=MIB // 256, mode="shard", init_timeout_s=60, senders=senders,
                                     group_key=world["key"])
    sync = WeightSyncCoordinator(transport, world["loop"], None)
    held = HeldJoin(world["state"]["handle"].client)
    fleet = [FleetEngine(held, EngineSpec("reference-0", 1, 1))]
    try:
        # Formation, then two pushes through the formed group with its store gone.
        sync.verifier = make_verifier(world, trainers[1])
        senders.senders.load(trainers[1].shards)
        port = push_while_watching(sync, fleet, held, senders, trainers[1], trainers[0], "v1")
        assert transport.generation == 1 and connect_errno(port) == errno.ECONNREFUSED
        assert_serves(world, fleet, trainers[1])
        sync.verifier = make_verifier(world, trainers[2])
        senders.senders.load(trainers[2].shards)
        report = sync.push(fleet, lambda: pytest.fail("shard mode gathers nothing"), "v2")
        assert transport.generation == 1 and len(senders.endpoints) == 1  # the same group, not re-formed
        assert report.verify is not None and report.verify.logp_diff_mean < 1e-6
        assert_serves(world, fleet, trainers[2])
        assert connect_errno(port) == errno.ECONNREFUSED

        # The engine restarts: its replacement (a new incarnation, as the fleet names it) joins a new group.
        launcher, loop_thread = world["launcher"], world["loop_thread"]
        loop_thread.run(launcher.stop(world["state"]["handle"]))
        world["state"]["handle"] = loop_thread.run(launcher.start(0))
        held = HeldJoin(world["state"]["handle"].client)
        fleet = [FleetEngine(held, EngineSpec("reference-0.1", 1, 1))]
        sync.verifier = make_verifier(world, trainers[3])
        senders.senders.load(trainers[3].shards)
        new_port = push_while_watching(sync, fleet, held, senders, trainers[3], trainers[0], "v3")
        assert transport.generation == 2 and new_port != port
        assert connect_errno(new_port) == errno.ECONNREFUSED and connect_errno(port) == errno.ECONNREFUSED
        assert_serves(world, fleet, trainers[3])
    finally:
        sync.close()


@pytest.mark.parametrize("engine_warm_up", [True, False], ids=["engines-warm-up", "sglang-join"])
def test_full_mode_closes_the_store_at_formation_or_after_the_first_broadcast(world, engine_warm_up):
    """Full mode (the driver broadcasts): with engines that warm the group up, `connect` returns with the store
    closed; with SGLang's own join (no warm-up on the engines' side, which the reference engine follows when rank
    0 asks for none), the store stays up until the first bucket reached every engine."""
    layouts = world["layouts"]
    transport = DistributedTransport(specs_from_layouts(layouts[0].values(), "float32"), TRAINER_TP, world["loop"],
                                     bucket_bytes=MIB // 256, mode="full", init_timeout_s=60,
                                     master_address=LOCAL_HOST, group_key=world["key"], engine_warm_up=engine_warm_up)
    fleet = [FleetEngine(world["state"]["handle"].client, EngineSpec("reference-full", 1, 1))]
    try:
        transport.connect(fleet)
        assert transport.endpoint is not None
        port = transport.endpoint[1]
        assert transport.rendezvous_open is (not engine_warm_up)
        assert connect_errno(port) == (0 if not engine_warm_up else errno.ECONNREFUSED)
        for seed, version in ((31, "f1"), (32, "f2")):
            trainer = Trainer(seed, world["spec"], layouts)
            report = transport.push(trainer.shards, version)
            assert transport.generation == 1 and report.buckets > 1
            assert not transport.rendezvous_open and connect_errno(port) == errno.ECONNREFUSED
            assert_serves(world, fleet, trainer)
    finally:
        transport.close()
