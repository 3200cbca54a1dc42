"""Weight sync into reference engines with TP > 1 (one process per engine rank), from trainer ranks that
each send their own slices (shard mode: every engine rank runs the SGLang weight-loader plugin, the same
function SGLang's TP workers call) or from a broadcasting driver (full mode); gloo on CPU.

After every push each engine must serve the trainer's weights bit for bit (every HF tensor read back
with `/get_weights_by_name`, atol 0) and score the probe like an HF forward of those weights.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from shard_senders import ProcessSenders
from test_weight_sync_reference import SHAPE, VOCAB, Trainer, make_verifier, megatron_locals

from miles_lite.config.schema import RolloutConfig
from miles_lite.engines.launcher import EngineLauncher
from miles_lite.engines.reference.model import serialize_named_tensors
from miles_lite.net.ports import LOCAL_HOST
from miles_lite.rollout.sync_api import EventLoopThread
from miles_lite.trainer.hf_convert import layout_for
from miles_lite.trainer.model import padded_vocab_size, spec_from_hf_config
from miles_lite.trainer.tiny_hf import make_tiny_hf_model
from miles_lite.weight_sync.buckets import MIB
from miles_lite.weight_sync.coordinator import WeightSyncCoordinator
from miles_lite.weight_sync.disk import DiskTransport
from miles_lite.weight_sync.distributed import DistributedTransport
from miles_lite.weight_sync.layouts import specs_from_layouts
from miles_lite.weight_sync.plan import EngineSpec
from miles_lite.weight_sync.transport import EngineLoop, FleetEngine

pytestmark = pytest.mark.slow
ENGINE_TPS = {"tp1": 1, "tp2": 2, "tp4": 4}  # tp4 > the model's 2 KV heads: KV heads replicated


def layouts_for(spec, tp: int) -> list[dict]:
    padded = padded_vocab_size(VOCAB, tp, 8)
    return [{n: layout_for(n, s, spec, r, tp, padded) for n, s in megatron_locals(spec, tp, padded).items()}
            for r in range(tp)]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("wsync_tp")
    model_dir = make_tiny_hf_model("qwen2", SHAPE, VOCAB, root / "init", seed=0)
    spec = spec_from_hf_config(model_dir)
    loop_thread = EventLoopThread("wsync-tp-test").start()
    launchers = {name: EngineLauncher(RolloutConfig(backend="reference", engines=1, engine_tp=tp,
                                                    startup_timeout_s=180), str(model_dir), str(root / name))
                 for name, tp in ENGINE_TPS.items()}

    async def start_all():
        return await asyncio.gather(*(launcher.start(0) for launcher in launchers.values()))

    handles = dict(zip(launchers, loop_thread.run(start_all()), strict=True))
    for name, h in handles.items():
        h.client.engine_id = name  # every launcher calls its engine reference-0
    senders = {tp: ProcessSenders(tp) for tp in (1, 2)}
    try:
        yield dict(root=root, model_dir=model_dir, spec=spec, loop=EngineLoop(loop_thread.loop, 120),
                   layouts={tp: layouts_for(spec, tp) for tp in (1, 2)}, senders=senders,
                   engines={name: FleetEngine(h.client, EngineSpec(name, ENGINE_TPS[name], 1))
                            for name, h in handles.items()})
    finally:
        for s in senders.values():
            s.close()
        for name, h in handles.items():
            loop_thread.run(launchers[name].stop(h))
        loop_thread.stop()


def assert_serves(world, fleet: list[FleetEngine], trainer: Trainer) -> None:
    for f in fleet:
        for name, tensor in trainer.hf.items():
            rows = world["loop"].run(f.engine.get_weights_by_name(name, tensor.shape[0]))
            assert torch.equal(torch.tensor(rows, dtype=tensor.dtype), tensor), (f.engine_id, name)


def shard_push(world, trainer_tp: int, names: list[str], seeds: tuple[int, int]) -> list:
    """Push trainer `seeds[1]`'s weights (engines hold `seeds[0]`'s or the initial ones) in shard mode."""
    layouts = world["layouts"][trainer_tp]
    old, new = (Trainer(s, world["spec"], layouts) for s in seeds)
    senders = world["senders"][trainer_tp]
    senders.load(new.shards)
    fleet = [world["engines"][n] for n in names]
    transport = DistributedTransport(specs_from_layouts(layouts[0].values(), "float32"), trainer_tp, world["loop"],
                                     bucket_bytes=MIB // 256, mode="shard", init_timeout_s=60, senders=senders,
                                     group_name=f"tp{trainer_tp}_{'_'.join(names)}")
    sync = WeightSyncCoordinator(transport, world["loop"], make_verifier(world, new))
    try:
        report = sync.push(fleet, lambda: pytest.fail("shard mode gathers nothing"), f"s{seeds[1]}")
    finally:
        sync.close()
    assert report.push.transport == "distributed/shard" and report.push.buckets > 1
    assert report.push.seconds["gather"] == 0.0
    # Vocab rows are not padded for reference engines: every byte sent is a byte of some rank's shards.
    assert transport.plan is not None
    assert report.push.bytes == sum(rp.nbytes for ranks in transport.plan.ranks for rp in ranks)
    assert report.verify is not None and report.verify.logp_diff_mean < 1e-6
    assert_serves(world, fleet, new)
    return [report, transport]


def test_trainer_tp1_to_engine_tp2(world):
    _, transport = shard_push(world, 1, ["tp2"], (0, 11))
    offset = transport.rank_offsets[world["engines"]["tp2"].engine_id]
    assert offset == 1 and {p.dst for s in transport.schedules for p in s[0].sends} == {1, 2}


def test_trainer_tp2_to_engine_tp2_is_one_to_one(world):
    report, transport = shard_push(world, 2, ["tp2"], (11, 12))
    offset = transport.rank_offsets[world["engines"]["tp2"].engine_id]
    assert offset == 2
    for schedules in transport.schedules:
        # Trainer rank t feeds engine rank t its split tensors: no slice crosses ranks when the TPs match;
        # only replicated tensors (norms; rank 0 is their source) and the embedding rows the trainer's vocab
        # padding (208 rows, 104 per rank) moves across go from trainer rank 0 to engine rank 1.
        assert {p.dst for p in schedules[1].sends} <= {offset + 1}
        crossing = [(t.name, t.length) for p in schedules[0].sends if p.dst == offset + 1 for t in p.blocks]
        assert all("norm" in n or (n == "model.embed_tokens.weight" and rows == 4) for n, rows in crossing), crossing


def test_trainer_tp2_to_mixed_engines(world):
    _, transport = shard_push(world, 2, ["tp1", "tp2"], (12, 13))
    tp1 = transport.rank_offsets[world["engines"]["tp1"].engine_id]
    # The TP=1 engine receives from both trainer ranks.
    assert all(any(p.dst == tp1 for p in s.sends) for s in transport.schedules[0])


def test_kv_heads_replicated_on_engine_tp4(world):
    shard_push(world, 2, ["tp4"], (13, 14))
    engine = world["engines"]["tp4"].engine
    assert world["loop"].run(engine.server_info())["tp_size"] == 4
    assert world["loop"].run(engine.model_info())["tp_size"] == 4


def test_full_broadcast_disk_and_tensor_updates_into_tp_engines(world):
    layouts = world["layouts"][2]
    specs = specs_from_layouts(layouts[0].values(), "float32")
    fleet = [world["engines"]["tp2"], world["engines"]["tp4"]]
    old, new, newer = (Trainer(s, world["spec"], layouts) for s in (14, 15, 16))
    transport = DistributedTransport(specs, 2, world["loop"], bucket_bytes=MIB // 32, mode="full", init_timeout_s=60,
                                     group_name="full_tp", master_address=LOCAL_HOST)
    sync = WeightSyncCoordinator(transport, world["loop"], make_verifier(world, new))
    try:
        report = sync.push(fleet, new.shards, "f15")
    finally:
        sync.close()
    assert report.verify is not None and report.verify.logp_diff_mean < 1e-6
    assert_serves(world, fleet, new)
    disk = DiskTransport(specs, 2, world["root"] / "disk", world["loop"], bucket_bytes=MIB // 32,
                         template_dir=world["model_dir"])
    disk.connect(fleet)
    disk.push(newer.shards, "d16")
    assert_serves(world, fleet, newer)
    # update_weights_from_tensor: one entry per TP rank, each rank slices its own.
    tp2 = world["engines"]["tp2"].engine
    payload = serialize_named_tensors(list(new.hf.items()))
    with pytest.raises(Exception, match="needs 2 entries"):
        world["loop"].run(tp2.update_weights_from_tensor([payload], None, "t15"))
    world["loop"].run(tp2.update_weights_from_tensor([payload, payload], None, "t15"))
    assert_serves(world, fleet[:1], new)
