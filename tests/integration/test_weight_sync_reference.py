"""Weight sync into real reference engines (HTTP servers in their own processes), gloo on CPU.

Trainer TP=2 Megatron-layout shards (built with the trainer's own `ParamLayout.assemble`) are pushed
as new weights; the engines must then serve them bit-exactly (rows read back with atol 0, probe logprobs
equal to an HF forward of the new weights), and an engine that drops updates must be named.
"""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest
import torch

from miles_lite.config.schema import RolloutConfig, TinyModelShape
from miles_lite.engines.launcher import EngineLauncher
from miles_lite.net.ports import LOCAL_HOST
from miles_lite.rollout.engine import EngineError
from miles_lite.rollout.sync_api import EventLoopThread
from miles_lite.trainer.hf_convert import layout_for
from miles_lite.trainer.model import padded_vocab_size, spec_from_hf_config
from miles_lite.trainer.tiny_hf import build_tiny_hf_model, make_tiny_hf_model
from miles_lite.weight_sync.buckets import MIB
from miles_lite.weight_sync.coordinator import WeightSyncCoordinator
from miles_lite.weight_sync.disk import DiskTransport, complete_versions
from miles_lite.weight_sync.distributed import DistributedTransport
from miles_lite.weight_sync.layouts import specs_from_layouts
from miles_lite.weight_sync.plan import EngineSpec
from miles_lite.weight_sync.transport import EngineLoop, FleetEngine, WeightSyncError
from miles_lite.weight_sync.verify import PushVerifier, make_probe

SHAPE = TinyModelShape(hidden_size=32, ffn_hidden_size=64, num_layers=2, num_attention_heads=4, num_kv_heads=2)
VOCAB = 200
TP = 2
pytestmark = pytest.mark.slow

CHECKSUM = ("model.embed_tokens.weight", "model.layers.1.self_attn.k_proj.weight", "model.layers.0.mlp.up_proj.weight")


def megatron_locals(spec, tp: int, padded: int) -> dict[str, tuple[int, ...]]:
    """Megatron local-spec parameter names and their TP-local shapes."""
    h, hd, ffn = spec.hidden_size, spec.head_dim, spec.ffn_hidden_size
    qkv = spec.num_kv_heads // tp * (spec.heads_per_group + 2) * hd
    shapes = {"embedding.word_embeddings.weight": (padded // tp, h)}
    for i in range(spec.num_layers):
        p = f"decoder.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (h,), p + "self_attention.linear_qkv.weight": (qkv, h),
                   p + "self_attention.linear_qkv.bias": (qkv,),
                   p + "self_attention.linear_proj.weight": (h, spec.num_attention_heads * hd // tp),
                   p + "pre_mlp_layernorm.weight": (h,), p + "mlp.linear_fc1.weight": (2 * ffn // tp, h),
                   p + "mlp.linear_fc2.weight": (h, ffn // tp)}
    shapes["decoder.final_layernorm.weight"] = (h,)
    return shapes


class Trainer:
    """Megatron-layout TP shards of an HF model, and its logprobs on the probe (the trainer's view)."""

    def __init__(self, seed: int, spec, layouts) -> None:
        self.model = build_tiny_hf_model("qwen2", SHAPE, VOCAB, seed)
        self.hf = {n: p.detach().clone() for n, p in self.model.state_dict().items()}
        self.shards = [{name: lay.assemble(self.hf) for name, lay in rank.items()} for rank in layouts]

    def logprobs(self, probe) -> list[list[float]]:
        out = []
        with torch.no_grad():
            for seq, plen in zip(probe.sequences, probe.prompt_lens, strict=True):
                ids = torch.tensor([seq])
                logp = torch.log_softmax(self.model(ids).logits[0].double(), dim=-1)
                out.append([float(logp[i - 1, seq[i]]) for i in range(plen, len(seq))])
        return out


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("wsync")
    model_dir = make_tiny_hf_model("qwen2", SHAPE, VOCAB, root / "init", seed=0)
    spec = spec_from_hf_config(model_dir)
    padded = padded_vocab_size(VOCAB, TP, 8)
    layouts = [{n: layout_for(n, s, spec, r, TP, padded) for n, s in megatron_locals(spec, TP, padded).items()}
               for r in range(TP)]
    loop_thread = EventLoopThread("wsync-test").start()
    launcher = EngineLauncher(RolloutConfig(backend="reference", engines=2, startup_timeout_s=120),
                              str(model_dir), str(root / "logs"))
    dropper = EngineLauncher(RolloutConfig(backend="reference", engines=1, startup_timeout_s=120,
                                           reference_args={"drop_weight_updates": True}),
                             str(model_dir), str(root / "logs-drop"))

    async def start_all():
        # Engines start concurrently: model loading dominates and the processes are independent.
        return await asyncio.gather(launcher.start(0), launcher.start(1), dropper.start(0))

    *engines, dropping = loop_thread.run(start_all())
    dropping.client.engine_id = "dropping-0"
    try:
        yield dict(root=root, model_dir=Path(model_dir), layouts=layouts,
                   specs=specs_from_layouts(layouts[0].values(), "float32"), loop=EngineLoop(loop_thread.loop, 120),
                   fleet=[FleetEngine(e.client, EngineSpec(e.client.engine_id, 1, vocab_pad_to=1)) for e in engines],
                   dropping=FleetEngine(dropping.client, EngineSpec("dropping-0", 1, vocab_pad_to=1)), spec=spec)
    finally:
        for e in engines:
            loop_thread.run(launcher.stop(e))
        loop_thread.run(dropper.stop(dropping))
        loop_thread.stop()


def engine_rows(world, fleet_engine, name, rows=1000) -> torch.Tensor:
    return torch.tensor(world["loop"].run(fleet_engine.engine.get_weights_by_name(name, rows)))


def make_verifier(world, trainer) -> PushVerifier:
    probe = make_probe(VOCAB, sequences=2, tokens=12, seed=3)
    return PushVerifier(world["loop"], probe, trainer.logprobs, max_probe_logp_diff=1e-4)


@pytest.mark.parametrize("bucket_mib", [1])
def test_distributed_full_push_is_bit_exact_and_reconnects(world, bucket_mib):
    old = Trainer(0, world["spec"], world["layouts"])
    new = Trainer(1, world["spec"], world["layouts"])
    transport = DistributedTransport(world["specs"], TP, world["loop"], bucket_bytes=bucket_mib * MIB // 16,
                                     mode="full", backend="gloo", init_timeout_s=60,
                                     master_address=LOCAL_HOST)
    sync = WeightSyncCoordinator(transport, world["loop"], make_verifier(world, new))
    try:
        report = sync.push(world["fleet"], lambda: new.shards, "1")
        assert report.push.buckets > 1 and report.push.bytes == sum(
            math.prod(s.shape) * 4 for s in world["specs"])
        assert report.verify is not None and report.verify.logp_diff_mean < 1e-6
        for f in world["fleet"]:
            for name in ("model.layers.0.self_attn.q_proj.weight", "model.norm.weight", "model.embed_tokens.weight"):
                assert torch.equal(engine_rows(world, f, name), new.hf[name]), (f.engine_id, name)
        # A smaller fleet is a new world: the transport rebuilds the group and pushes again.
        sync.verifier = make_verifier(world, old)
        report = sync.push(world["fleet"][:1], old.shards, "2")
        assert transport.generation == 2 and report.push.engines == (world["fleet"][0].engine_id,)
        assert torch.equal(engine_rows(world, world["fleet"][0], CHECKSUM[1]), old.hf[CHECKSUM[1]])
    finally:
        sync.close()


def test_disk_push_round_trip_and_retention(world):
    new = Trainer(2, world["spec"], world["layouts"])
    root = world["root"] / "disk"
    transport = DiskTransport(world["specs"], TP, root, world["loop"], bucket_bytes=32 * 1024, keep_versions=2,
                              template_dir=world["model_dir"])
    transport.connect(world["fleet"])
    for version in ("10", "11", "12"):
        report = transport.push(new.shards, version)
    assert [p.name for p in complete_versions(root)] == ["v11", "v12"]
    assert (root / "v12" / "config.json").exists() and report.buckets > 1
    for f in world["fleet"]:
        assert world["loop"].run(f.engine.weight_version()) == "12"
        assert torch.equal(engine_rows(world, f, CHECKSUM[2]), new.hf[CHECKSUM[2]])
    # A repeated push of the last version reloads its files; a version already on disk that this transport
    # did not just publish (an earlier run's) is never overwritten.
    transport.push(new.shards, "12")
    assert [p.name for p in complete_versions(root)] == ["v11", "v12"]
    again = DiskTransport(world["specs"], TP, root, world["loop"], bucket_bytes=32 * 1024, keep_versions=2,
                          template_dir=world["model_dir"])
    again.connect(world["fleet"])
    with pytest.raises(FileExistsError):
        again.push(new.shards, "12")


def test_engine_that_keeps_old_weights_is_named(world):
    new = Trainer(4, world["spec"], world["layouts"])
    fleet = [world["fleet"][0], world["dropping"]]
    transport = DistributedTransport(world["specs"], TP, world["loop"], bucket_bytes=4 * MIB, mode="full",
                                     backend="gloo", init_timeout_s=60, group_name="drop_test",
                                     master_address=LOCAL_HOST)
    # The dropping engine serves the initial weights and ignores the update: its probe scores stay the same.
    sync = WeightSyncCoordinator(transport, world["loop"], make_verifier(world, new))
    try:
        with pytest.raises(WeightSyncError, match="engine dropping-0: .*kept the old weights") as err:
            sync.push(fleet, new.shards, "5")
        assert fleet[0].engine_id not in str(err.value)
    finally:
        sync.close()


def test_a_push_that_changes_nothing_is_not_a_drop_but_a_later_drop_is_named(world):
    old = Trainer(0, world["spec"], world["layouts"])
    new = Trainer(4, world["spec"], world["layouts"])
    fleet = [world["dropping"]]  # serves the initial (= `old`) weights and ignores every update
    transport = DistributedTransport(world["specs"], TP, world["loop"], bucket_bytes=4 * MIB, mode="full",
                                     backend="gloo", init_timeout_s=60, group_name="noop_test",
                                     master_address=LOCAL_HOST)
    verifier = make_verifier(world, old)
    sync = WeightSyncCoordinator(transport, world["loop"], verifier)
    try:
        # The trainer still holds what the engine serves (an optimizer step that changed nothing):
        # unchanged probe scores are correct here, twice in a row.
        for version in ("20", "21"):
            report = sync.push(fleet, old.shards, version)
            assert report.verify is not None and report.verify.logp_diff_max < 1e-6
        # Now the trainer's weights move and the engine keeps the old ones: named as a dropped update.
        verifier.trainer_logprobs = new.logprobs
        with pytest.raises(WeightSyncError, match="engine dropping-0: acknowledged version 22 but its probe "
                                                  "logprobs are unchanged"):
            sync.push(fleet, new.shards, "22")
    finally:
        sync.close()


class FailsDiskLoad:
    """An engine client whose disk loads fail (its process died mid-push); everything else delegates."""

    def __init__(self, client) -> None:
        self.client = client

    def __getattr__(self, name):
        return getattr(self.client, name)

    async def update_weights_from_disk(self, model_path: str, weight_version: str) -> None:
        raise EngineError(f"{self.client.engine_id} /update_weights_from_disk: Server disconnected")


def test_a_push_repeated_without_a_failed_engine_verifies_against_the_first_attempt(world):
    """Attempt 1 loads the new weights into engine A and fails on B; the repeat to A alone must compare A with
    its scores from before attempt 1 (A already serves the new weights, which is not a dropped update) and
    reuse the published files."""
    old = Trainer(0, world["spec"], world["layouts"])
    new = Trainer(6, world["spec"], world["layouts"])
    a, b = world["fleet"]
    failing = FleetEngine(FailsDiskLoad(b.engine), b.spec)
    root = world["root"] / "disk-repeat"
    transport = DiskTransport(world["specs"], TP, root, world["loop"], bucket_bytes=32 * 1024, keep_versions=2,
                              template_dir=world["model_dir"])
    verifier = make_verifier(world, old)
    sync = WeightSyncCoordinator(transport, world["loop"], verifier)
    try:
        sync.push([a], old.shards, "30")  # a verified push of the weights A serves
        verifier.trainer_logprobs = new.logprobs
        with pytest.raises(WeightSyncError, match="Server disconnected"):
            sync.push([a, failing], new.shards, "31")
        assert world["loop"].run(a.engine.weight_version()) == "31"
        written = (root / "v31" / "model.safetensors.index.json").stat().st_mtime_ns
        report = sync.push([a], new.shards, "31")
        assert report.verify is not None and report.verify.logp_diff_max < 1e-4
        assert (root / "v31" / "model.safetensors.index.json").stat().st_mtime_ns == written
    finally:
        sync.close()
