"""Stock SGLang on a real GPU: the RolloutEngine contract, and weight pushes checked by the probe verifier.

Two servers, one after the other (class-scoped, so the first is gone before the second starts):

- `TestSGLangContract`: the shared engine contract (`engine_contract.EngineContract`) against a tiny fp32
  Qwen2 (head_dim 64: SGLang's precompiled RoPE kernels cover 64/128/256/512 only), launched through
  `EngineLauncher` with `enable_deterministic_inference` (in `SGLANG_TEST_ARGS`; without it SGLang ignores
  `sampling_seed`).
- `TestWeightPush`: a random Qwen2.5-0.5B-shaped model served in bf16 with `conf/rollout/sglang.yaml`'s
  flags; pushes through `DiskTransport` (`/update_weights_from_disk`), `IpcTransport` (CUDA IPC
  handles, `/update_weights_from_tensor` with `load_format="direct"`) and `DistributedTransport` in
  shard mode (the weight-loader plugin, gloo: trainer and engine share the GPU, which NCCL refuses),
  each verified against an HF forward of the pushed weights, restored bit-exactly, and a push the
  engine acknowledges but drops is named by `PushVerifier`.

Skipped unless sglang is importable and a CUDA device is present. Timings are printed as
`SGLANG_GPU_RESULT {json}` lines (run with `-s`).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "integration"))

from engine_contract import GREEDY, PROMPT, SGLANG_SLEEP_ARGS, EngineContract, run  # noqa: E402

from miles_lite.config.schema import RolloutConfig, TinyModelShape  # noqa: E402
from miles_lite.engines.launcher import EngineLauncher, LaunchedEngine  # noqa: E402
from miles_lite.engines.sglang.command import sglang_available  # noqa: E402
from miles_lite.net.ports import LOCAL_HOST, free_port  # noqa: E402
from miles_lite.rollout.http_client import HttpEngine  # noqa: E402
from miles_lite.rollout.sync_api import EventLoopThread  # noqa: E402
from miles_lite.trainer.hf_convert import layout_for, read_hf_state  # noqa: E402
from miles_lite.trainer.model import padded_vocab_size, spec_from_hf_config  # noqa: E402
from miles_lite.trainer.tiny_hf import (  # noqa: E402
    QWEN25_05B_SHAPE,
    QWEN25_VOCAB,
    build_tiny_hf_model,
    make_tiny_hf_model,
)
from miles_lite.types import SamplingParams  # noqa: E402
from miles_lite.weight_sync.buckets import MIB  # noqa: E402
from miles_lite.weight_sync.coordinator import SyncReport, WeightSyncCoordinator  # noqa: E402
from miles_lite.weight_sync.disk import DiskTransport  # noqa: E402
from miles_lite.weight_sync.distributed import DistributedTransport  # noqa: E402
from miles_lite.weight_sync.ipc import IpcTransport, serialize_named_tensors  # noqa: E402
from miles_lite.weight_sync.layouts import specs_from_layouts  # noqa: E402
from miles_lite.weight_sync.plan import EngineSpec, ParamSpec  # noqa: E402
from miles_lite.weight_sync.senders import RankSender  # noqa: E402
from miles_lite.weight_sync.shard_protocol import RankSchedule, SendStats  # noqa: E402
from miles_lite.weight_sync.transport import EngineLoop, FleetEngine, WeightSyncError  # noqa: E402
from miles_lite.weight_sync.verify import ProbeBatch, PushVerifier, make_probe  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not sglang_available(), reason="needs sglang importable and a CUDA GPU"),
]

REPO = Path(__file__).resolve().parents[2]
STARTUP_S = 300.0

# Contract model: tiny, but with head_dim 64 and room for the 800-token abort request.
CONTRACT_SHAPE = TinyModelShape(hidden_size=256, ffn_hidden_size=512, num_layers=2, num_attention_heads=4,
                                num_kv_heads=2, max_position_embeddings=2048)
CONTRACT_VOCAB = 512

# Probe |logp diff| mean allowed between the bf16 engine and the fp32 HF forward of the same weights.
# Two random models of this shape differ by ~0.7 nats/token, so a stale engine is far above it.
PROBE_TOL = 0.1
BUCKET_BYTES = 512 * MIB


def result(name: str, **fields: Any) -> None:
    """Print one measurement as a greppable JSON line."""
    print(f"SGLANG_GPU_RESULT {json.dumps({'name': name, **fields})}", flush=True)


def sglang_yaml_args() -> dict[str, Any]:
    """`conf/rollout/sglang.yaml`'s sglang_args, bf16 (what a real Qwen2.5 checkpoint declares), no CUDA graphs.

    The shipped config turns prefill CUDA graphs off (SGLang 0.5.10 captured 58 piecewise prefill sizes even
    with `--disable-cuda-graph`, over 45 s of startup on the H200); decode graphs are turned off here too.
    """
    import yaml

    cfg = yaml.safe_load((REPO / "conf" / "rollout" / "sglang.yaml").read_text())
    return {**cfg["sglang_args"], "disable_cuda_graph": True, "dtype": "bfloat16"}


# ------------------------------------------------------------------------------------------ engine contract


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """Two tiny fp32 Qwen2 checkpoints with different random weights (A is what the engine starts with)."""
    root = tmp_path_factory.mktemp("contract-models")
    return (str(make_tiny_hf_model("qwen2", CONTRACT_SHAPE, CONTRACT_VOCAB, root / "a", seed=0)),
            str(make_tiny_hf_model("qwen2", CONTRACT_SHAPE, CONTRACT_VOCAB, root / "b", seed=1)))


@pytest.fixture(scope="class")
def engine(model_dirs: tuple[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[LaunchedEngine]:
    """One SGLang server on model A for the contract class, stopped (process group) after it."""
    args = dict(SGLANG_SLEEP_ARGS)
    rollout = RolloutConfig(backend="sglang", engines=1, engine_tp=1, startup_timeout_s=STARTUP_S,
                            request_timeout_s=120.0, sglang_args=args)
    launcher = EngineLauncher(rollout, model_dirs[0], str(tmp_path_factory.mktemp("logs-contract")))
    launched = run(launcher.start(0))
    try:
        yield launched
    finally:
        run(launcher.stop(launched))


class TestSGLangContract(EngineContract):
    """The shared contract on stock SGLang (seeded sampling needs `enable_deterministic_inference`)."""

    def test_stop_token_ids(self, engine: LaunchedEngine) -> None:
        """SGLang skips every token-based stop, `stop_token_ids` included, when `ignore_eos` is set
        (`Req._check_token_based_finish` returns first), so the shared test's `ignore_eos=True` request runs to
        max_new_tokens there; rollouts never set `ignore_eos` with stop ids, so the check runs without it."""
        plain = SamplingParams(max_new_tokens=12, temperature=0.0)
        base = run(engine.client.generate(PROMPT, plain))
        assert len(base.output_ids) >= 4, "the model hit its EOS before 4 tokens; pick another prompt"
        stop_at = base.output_ids.index(base.output_ids[3])
        gen = run(engine.client.generate(PROMPT, replace(plain, stop_token_ids=(base.output_ids[3],))))
        assert gen.finish_reason == "stop"
        assert gen.output_ids == base.output_ids[: stop_at + 1]

    def test_pause_holds_requests_until_continue(self, engine: LaunchedEngine) -> None:
        """SGLang holds requests sent while paused in its tokenizer manager (`is_pause_cond`), before the
        scheduler, so `/get_load` never lists them (the shared test waits for that); what must hold is that
        none completes while paused and all do after `/continue_generation`."""

        async def scenario() -> tuple[Any, dict[str, Any]]:
            await engine.client.pause(mode="in_place")
            try:
                task = asyncio.create_task(engine.client.generate(PROMPT, GREEDY))
                await asyncio.sleep(1.0)  # observation window: a running engine answers this in milliseconds
                assert not task.done()
                load = (await engine.client.load())[0]
            finally:
                await engine.client.resume()
            return await asyncio.wait_for(task, 60.0), load

        gen, load = run(scenario())
        assert load["num_reqs"] == 0
        assert gen.finish_reason == "length" and len(gen.output_ids) == GREEDY.max_new_tokens


# ------------------------------------------------------------------------------------------ weight pushes


def megatron_locals(spec: Any, padded_vocab: int) -> dict[str, tuple[int, ...]]:
    """Megatron local-spec parameter names and shapes of a TP=1 GPTModel with tied embeddings."""
    h, hd, ffn = spec.hidden_size, spec.head_dim, spec.ffn_hidden_size
    qkv = spec.num_kv_heads * (spec.heads_per_group + 2) * hd
    shapes: dict[str, tuple[int, ...]] = {"embedding.word_embeddings.weight": (padded_vocab, h)}
    for i in range(spec.num_layers):
        p = f"decoder.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (h,), p + "self_attention.linear_qkv.weight": (qkv, h),
                   p + "self_attention.linear_qkv.bias": (qkv,),
                   p + "self_attention.linear_proj.weight": (h, spec.num_attention_heads * hd),
                   p + "pre_mlp_layernorm.weight": (h,), p + "mlp.linear_fc1.weight": (2 * ffn, h),
                   p + "mlp.linear_fc2.weight": (h, ffn)}
    shapes["decoder.final_layernorm.weight"] = (h,)
    return shapes


class Policy:
    """One set of weights as the trainer holds them: Megatron-layout bf16 shards (CPU and GPU) and an fp32
    HF model on the GPU that scores the probe (the trainer's logprobs)."""

    def __init__(self, model: Any, layouts: dict[str, Any]) -> None:
        hf = {n: p.detach() for n, p in model.state_dict().items()}
        self.shards_cpu = [{name: lay.assemble(hf).to(torch.bfloat16) for name, lay in layouts.items()}]
        self.shards_gpu = [{n: t.cuda() for n, t in self.shards_cpu[0].items()}]
        self.hf_bf16_gpu = {n: t.to("cuda", torch.bfloat16) for n, t in hf.items() if n != "lm_head.weight"}
        self.model = model.cuda().eval()

    def logprobs(self, probe: ProbeBatch) -> list[list[float]]:
        """log p(token | prefix) (nats) of every probe token after its prompt, fp32 forward."""
        out = []
        with torch.no_grad():
            for seq, plen in zip(probe.sequences, probe.prompt_lens, strict=True):
                logits = self.model(input_ids=torch.tensor([seq], device="cuda")).logits[0].double()
                logp = torch.log_softmax(logits, dim=-1)
                out.append([float(logp[i - 1, seq[i]]) for i in range(plen, len(seq))])
        return out


@dataclass
class World:
    """The 0.5B server, the event loop its client lives on, and the two policies (A served first, B new)."""

    root: Path
    a_dir: Path
    loop: EngineLoop
    client: HttpEngine
    fleet: list[FleetEngine]
    specs: list[ParamSpec]
    old: Policy
    new: Policy
    probe: ProbeBatch
    baseline: torch.Tensor

    def scores(self) -> torch.Tensor:
        """The engine's probe logprobs, flattened (float64)."""
        rows = [self.loop.run(self.client.score(list(s), p))
                for s, p in zip(self.probe.sequences, self.probe.prompt_lens, strict=True)]
        return torch.tensor([v for row in rows for v in row], dtype=torch.float64)

    def verifier(self, policy: Policy) -> PushVerifier:
        return PushVerifier(self.loop, self.probe, policy.logprobs, max_probe_logp_diff=PROBE_TOL)


@pytest.fixture(scope="class")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    root = tmp_path_factory.mktemp("qwen05b")
    a_dir = make_tiny_hf_model("qwen2", QWEN25_05B_SHAPE, QWEN25_VOCAB, root / "a", seed=0)
    rollout = RolloutConfig(backend="sglang", engines=1, engine_tp=1, startup_timeout_s=STARTUP_S,
                            request_timeout_s=300.0, sglang_args=sglang_yaml_args())
    launcher = EngineLauncher(rollout, str(a_dir), str(root / "logs"))
    process = launcher.create(0)
    loop_thread = EventLoopThread("sglang-gpu-test").start()
    client: HttpEngine | None = None
    process.start()
    try:
        # The trainer side is built while the server starts (CPU work that overlaps its startup).
        spec = spec_from_hf_config(a_dir)
        padded = padded_vocab_size(QWEN25_VOCAB, 1, 128)
        layouts = {n: layout_for(n, s, spec, 0, 1, padded) for n, s in megatron_locals(spec, padded).items()}
        from transformers import AutoModelForCausalLM

        model_a = AutoModelForCausalLM.from_pretrained(str(a_dir), dtype=torch.float32)
        assert set(read_hf_state(a_dir)) >= {"model.embed_tokens.weight", "model.norm.weight"}
        old = Policy(model_a, layouts)
        new = Policy(build_tiny_hf_model("qwen2", QWEN25_05B_SHAPE, QWEN25_VOCAB, seed=1), layouts)
        process.wait_ready(STARTUP_S)
        client = HttpEngine(launcher.engine_id(0), process.url, request_timeout_s=300.0, vocab_size=QWEN25_VOCAB)
        loop = EngineLoop(loop_thread.loop, timeout_s=300.0)
        w = World(root=root, a_dir=Path(a_dir), loop=loop, client=client,
                  fleet=[FleetEngine(client, EngineSpec(client.engine_id, 1))],
                  specs=specs_from_layouts(layouts.values(), "bfloat16"), old=old, new=new,
                  probe=make_probe(QWEN25_VOCAB, sequences=4, tokens=64, seed=0), baseline=torch.empty(0))
        w.baseline = w.scores()
        yield w
    finally:
        if client is not None:
            loop_thread.run(client.close())
        loop_thread.stop()
        process.stop()


def _report(name: str, rep: SyncReport) -> None:
    push = rep.push
    result(name, transport=push.transport, version=push.version, gb=push.bytes / 1e9, buckets=push.buckets,
           seconds={k: round(v, 4) for k, v in push.seconds.items()}, push_s=round(push.total_seconds, 4),
           gb_per_s=round(push.gb_per_s, 2), paused_s=round(rep.paused_s, 4),
           probe_diff_mean=rep.verify.logp_diff_mean if rep.verify else None,
           probe_diff_max=rep.verify.logp_diff_max if rep.verify else None)


class InProcessSender:
    """The trainer's one TP rank as a `ShardSenders`: sends from GPU tensors in this process."""

    def __init__(self) -> None:
        self.sender = RankSender(0)
        self.shards: dict[str, torch.Tensor] = {}

    def weight_group_endpoint(self) -> tuple[str, int]:
        # The engine runs on this machine: the rendezvous this process hosts is on loopback.
        return LOCAL_HOST, free_port(LOCAL_HOST)

    def join_weight_group(self, master_address: str, master_port: int, world_size: int, group_name: str,
                          backend: str, timeout_s: float, key: str | None = None) -> None:
        self.sender.join(master_address, master_port, world_size, group_name, backend, timeout_s, key)

    def send_weight_bucket(self, schedules: list[RankSchedule]) -> list[SendStats]:
        return [self.sender.send(self.shards, schedules[0])]

    def leave_weight_group(self) -> None:
        self.sender.leave()


class AcknowledgingDropper:
    """An engine whose weight updates are acknowledged (version bumped, HTTP 200) but never loaded: the real
    SGLang server behind it keeps serving its old weights, as after an update swallowed by the engine."""

    def __init__(self, inner: HttpEngine) -> None:
        self._inner = inner
        self.engine_id = inner.engine_id
        self.url = inner.url

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def update_weights_from_tensor(self, serialized_named_tensors: list[str], load_format: str | None,
                                         weight_version: str, flush_cache: bool = True) -> None:
        await self._inner.update_weight_version(weight_version)

    async def update_weights_from_disk(self, model_path: str, weight_version: str) -> None:
        await self._inner.update_weight_version(weight_version)


class TestWeightPush:
    """Weight pushes into a 0.5B-shaped bf16 SGLang engine on one GPU."""

    def test_serves_initial_weights(self, world: World) -> None:
        want = torch.tensor([v for row in world.old.logprobs(world.probe) for v in row], dtype=torch.float64)
        diff = (world.baseline - want).abs()
        result("initial_probe", diff_mean=float(diff.mean()), diff_max=float(diff.max()))
        assert float(diff.mean()) < PROBE_TOL
        other = torch.tensor([v for row in world.new.logprobs(world.probe) for v in row], dtype=torch.float64)
        assert float((other - want).abs().mean()) > 5 * PROBE_TOL  # the probe tells the two policies apart

    def test_disk_push_verified_and_restored(self, world: World) -> None:
        transport = DiskTransport(world.specs, 1, world.root / "weights", world.loop, bucket_bytes=BUCKET_BYTES,
                                  template_dir=world.a_dir)
        sync = WeightSyncCoordinator(transport, world.loop, world.verifier(world.new))
        try:
            rep = sync.push(world.fleet, lambda: world.new.shards_cpu, "disk-b")
            _report("disk_push_b", rep)
            assert rep.verify is not None and rep.verify.logp_diff_mean < PROBE_TOL
            assert world.loop.run(world.client.weight_version()) == "disk-b"
            sync.verifier = world.verifier(world.old)
            rep = sync.push(world.fleet, lambda: world.old.shards_cpu, "disk-a")
            _report("disk_push_a", rep)
        finally:
            sync.close()
        restored = world.scores()
        result("disk_restore", max_abs_diff=float((restored - world.baseline).abs().max()))
        assert torch.equal(restored, world.baseline)

    def test_ipc_push_verified_and_matches_hf_name_load(self, world: World) -> None:
        transport = IpcTransport(world.specs, 1, world.loop, bucket_bytes=BUCKET_BYTES)
        sync = WeightSyncCoordinator(transport, world.loop)
        try:
            for round_ in range(2):  # the second round is the warm figure
                sync.verifier = world.verifier(world.new)
                rep = sync.push(world.fleet, lambda: world.new.shards_gpu, f"ipc-b{round_}")
                _report(f"ipc_push_b{round_}", rep)
                assert rep.verify is not None and rep.verify.logp_diff_mean < PROBE_TOL
                direct_b = world.scores()
                sync.verifier = world.verifier(world.old)
                rep = sync.push(world.fleet, lambda: world.old.shards_gpu, f"ipc-a{round_}")
                _report(f"ipc_push_a{round_}", rep)
        finally:
            sync.close()
        assert torch.equal(world.scores(), world.baseline)
        # SGLang's own loader (HF names, stacked q/k/v and gate/up) must give the same parameters as the fused
        # per-rank tensors that `direct` copies in.
        payload = serialize_named_tensors(list(world.new.hf_bf16_gpu.items()))
        world.loop.run(world.client.update_weights_from_tensor([payload], None, "hf-names-b"))
        torch.cuda.synchronize()
        by_name = world.scores()
        result("hf_name_vs_direct", max_abs_diff=float((by_name - direct_b).abs().max()))
        payload = serialize_named_tensors(list(world.old.hf_bf16_gpu.items()))
        world.loop.run(world.client.update_weights_from_tensor([payload], None, "hf-names-a"))
        assert torch.equal(by_name, direct_b)
        assert torch.equal(world.scores(), world.baseline)

    def test_plugin_push_over_gloo_verified_and_restored(self, world: World) -> None:
        """Shard mode into stock SGLang: the engine's TP worker runs the project's weight-loader plugin, which
        joins a gloo group with the trainer rank and copies the received blocks into its fused parameters."""
        sender = InProcessSender()
        transport = DistributedTransport(world.specs, 1, world.loop, bucket_bytes=BUCKET_BYTES, mode="shard",
                                         backend="gloo", senders=sender, init_timeout_s=120.0)
        sync = WeightSyncCoordinator(transport, world.loop)
        try:
            for round_ in range(2):  # the first round also forms the group; the second is the warm figure
                sender.shards = world.new.shards_gpu[0]
                sync.verifier = world.verifier(world.new)
                rep = sync.push(world.fleet, lambda: pytest.fail("shard mode gathers nothing"), f"plugin-b{round_}")
                _report(f"plugin_push_b{round_}", rep)
                assert rep.verify is not None and rep.verify.logp_diff_mean < PROBE_TOL
                assert rep.push.transport == "distributed/shard" and rep.push.seconds["gather"] == 0.0
                sender.shards = world.old.shards_gpu[0]
                sync.verifier = world.verifier(world.old)
                rep = sync.push(world.fleet, lambda: pytest.fail("shard mode gathers nothing"), f"plugin-a{round_}")
                _report(f"plugin_push_a{round_}", rep)
        finally:
            sync.close()
        restored = world.scores()
        result("plugin_restore", max_abs_diff=float((restored - world.baseline).abs().max()))
        assert torch.equal(restored, world.baseline)

    def test_full_broadcast_over_gloo_verified_and_restored(self, world: World) -> None:
        """mode=full: SGLang's own init_weights_update_group / update_weights_from_distributed, full HF tensors
        broadcast from this process (gloo, the engine receiving into GPU tensors)."""
        # SGLang's own group join runs no warm-up: the store stays up until the first broadcast reached it.
        transport = DistributedTransport(world.specs, 1, world.loop, bucket_bytes=BUCKET_BYTES, mode="full",
                                         backend="gloo", init_timeout_s=120.0, master_address=LOCAL_HOST,
                                         engine_warm_up=False)
        sync = WeightSyncCoordinator(transport, world.loop)
        try:
            sync.verifier = world.verifier(world.new)
            rep = sync.push(world.fleet, lambda: world.new.shards_cpu, "full-b")
            _report("full_push_b", rep)
            assert rep.verify is not None and rep.verify.logp_diff_mean < PROBE_TOL
            sync.verifier = world.verifier(world.old)
            _report("full_push_a", sync.push(world.fleet, lambda: world.old.shards_cpu, "full-a"))
        finally:
            sync.close()
        assert torch.equal(world.scores(), world.baseline)

    def test_acknowledged_but_dropped_push_is_named(self, world: World) -> None:
        dropper = AcknowledgingDropper(world.client)
        fleet = [FleetEngine(dropper, EngineSpec(dropper.engine_id, 1))]
        sync = WeightSyncCoordinator(IpcTransport(world.specs, 1, world.loop, bucket_bytes=BUCKET_BYTES),
                                     world.loop, world.verifier(world.new))
        try:
            with pytest.raises(WeightSyncError, match=rf"engine {dropper.engine_id}: (acknowledged|probe)") as err:
                sync.push(fleet, lambda: world.new.shards_gpu, "dropped-b")
        finally:
            sync.close()
        result("dropped_push", error=str(err.value)[:300])
        assert world.loop.run(world.client.weight_version()) == "dropped-b"  # the engine did acknowledge
        assert torch.equal(world.scores(), world.baseline)  # and still serves the old weights
