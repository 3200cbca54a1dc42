"""Stock SGLang serving a Qwen3-MoE on a real GPU: generation, log-probs, verified weight pushes, routed experts.

A tiny random `Qwen3MoeForCausalLM` (the project's tiny model maker) of a shape SGLang's fused-MoE triton
kernels take: hidden 256 and expert FFN 128 (multiples of the kernels' 64/128 blocks), head_dim 64 (SGLang's
precompiled RoPE kernels), 8 experts top-2, every layer sparse (SGLang's Qwen3-MoE ignores `mlp_only_layers`
and builds an MoE block in every layer). One server, started through `EngineLauncher` with the engine
contract's `SGLANG_TEST_ARGS` (float32: the tolerance `LOGPROB_TOL["sglang"]` is the fp32 one) plus
`enable_return_routed_experts`:

- greedy generation works and its sampled log-probs match an HF float32 forward;
- the engine's scored log-probs match the HF forward within `LOGPROB_TOL["sglang"]`;
- pushes of other weights, each verified by `PushVerifier`, move the log-probs onto the new HF forward, and
  pushing the originals back restores them: by disk (`DiskTransport`: Megatron-layout shards -> HF safetensors
  -> `/update_weights_from_disk`, SGLang's own MoE loader), through the weight-loader plugin (shard mode: blocks
  copied into SGLang's stacked `w13_weight` / `w2_weight`) and by CUDA IPC (`direct`: the stacked tensors);
- `return_routed_experts` answers carry every position's top-k ids at every layer, parsed the way the rollout
  reads them (`HttpEngine` -> `RoutingLayout.sample_ids`), and they are the experts HF's router picks.

Skipped unless sglang is importable and a CUDA device is present. Results are printed as
`SGLANG_MOE_GPU_RESULT {json}` lines (run with `-s`).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "integration"))

from engine_contract import LOGPROB_TOL, SGLANG_TEST_ARGS  # noqa: E402
from test_sglang_gpu import InProcessSender  # noqa: E402

from miles_lite.config.schema import RolloutConfig, TinyModelShape  # noqa: E402
from miles_lite.engines.launcher import EngineLauncher, LaunchedEngine  # noqa: E402
from miles_lite.engines.sglang.command import sglang_available  # noqa: E402
from miles_lite.rollout.routing import RoutingLayout  # noqa: E402
from miles_lite.rollout.sync_api import EventLoopThread  # noqa: E402
from miles_lite.trainer.hf_convert import layout_for  # noqa: E402
from miles_lite.trainer.layout import ParamLayout  # noqa: E402
from miles_lite.trainer.model import HFModelSpec, padded_vocab_size, spec_from_hf_config  # noqa: E402
from miles_lite.trainer.tiny_hf import build_tiny_hf_model, checkpoint_state, make_tiny_hf_model  # noqa: E402
from miles_lite.types import SamplingParams  # noqa: E402
from miles_lite.weight_sync.buckets import MIB  # noqa: E402
from miles_lite.weight_sync.coordinator import WeightSyncCoordinator  # noqa: E402
from miles_lite.weight_sync.disk import DiskTransport  # noqa: E402
from miles_lite.weight_sync.distributed import DistributedTransport  # noqa: E402
from miles_lite.weight_sync.ipc import IpcTransport  # noqa: E402
from miles_lite.weight_sync.layouts import specs_from_layouts  # noqa: E402
from miles_lite.weight_sync.plan import EngineSpec, ParamSpec  # noqa: E402
from miles_lite.weight_sync.transport import EngineLoop, FleetEngine  # noqa: E402
from miles_lite.weight_sync.verify import ProbeBatch, PushVerifier, make_probe  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not sglang_available(), reason="needs sglang importable and a CUDA GPU"),
]

STARTUP_S = 600.0
VOCAB = 512
MOE_SHAPE = TinyModelShape(hidden_size=256, ffn_hidden_size=512, num_layers=2, num_attention_heads=4,
                           num_kv_heads=2, head_dim=64, max_position_embeddings=2048, tie_word_embeddings=False,
                           qkv_bias=False, qk_norm=True, num_experts=8, num_experts_per_tok=2,
                           moe_ffn_hidden_size=128, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
TOL = LOGPROB_TOL["sglang"]
# Share of (position, layer) top-k sets the engine's router must pick as HF's does: float32 against the
# kernels' rounding, a near tie may flip.
MIN_ROUTER_AGREEMENT = 0.95
PROMPT = [5, 17, 42, 99, 3, 250, 7, 311]


def result(name: str, **fields: Any) -> None:
    """Print one measurement as a greppable JSON line."""
    print(f"SGLANG_MOE_GPU_RESULT {json.dumps({'name': name, **fields})}", flush=True)


def megatron_moe_locals(spec: HFModelSpec, padded_vocab: int) -> dict[str, tuple[int, ...]]:
    """Megatron local-spec parameter names and shapes of a TP=1, EP=1 Qwen3-MoE `GPTModel` (untied, QK-norm,
    routed experts as `SequentialMLP.local_experts`)."""
    h, hd, f = spec.hidden_size, spec.head_dim, spec.moe_ffn_hidden_size
    qkv = spec.num_kv_heads * (spec.heads_per_group + 2) * hd
    shapes: dict[str, tuple[int, ...]] = {"embedding.word_embeddings.weight": (padded_vocab, h)}
    for i in range(spec.num_layers):
        p = f"decoder.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (h,), p + "self_attention.linear_qkv.weight": (qkv, h),
                   p + "self_attention.q_layernorm.weight": (hd,), p + "self_attention.k_layernorm.weight": (hd,),
                   p + "self_attention.linear_proj.weight": (h, spec.num_attention_heads * hd),
                   p + "pre_mlp_layernorm.weight": (h,), p + "mlp.router.weight": (spec.num_experts, h)}
        for e in range(spec.num_experts):
            shapes |= {p + f"mlp.experts.local_experts.{e}.linear_fc1.weight": (2 * f, h),
                       p + f"mlp.experts.local_experts.{e}.linear_fc2.weight": (h, f)}
    shapes["decoder.final_layernorm.weight"] = (h,)
    shapes["output_layer.weight"] = (padded_vocab, h)
    return shapes


def moe_layouts(model_dir: Path) -> dict[str, ParamLayout]:
    spec = spec_from_hf_config(model_dir)
    padded = padded_vocab_size(VOCAB, 1, 128)
    return {n: layout_for(n, s, spec, 0, 1, padded) for n, s in megatron_moe_locals(spec, padded).items()}


class Policy:
    """One set of weights as the trainer holds them (Megatron-layout fp32 shards) and the fp32 HF model on the
    GPU that scores them (the trainer's log-probs)."""

    def __init__(self, model: Any, layouts: dict[str, ParamLayout]) -> None:
        hf = {n: t.detach().clone() for n, t in checkpoint_state(model).items()}
        self.shards = [{name: lay.assemble(hf) for name, lay in layouts.items()}]
        self.shards_gpu = [{name: t.cuda() for name, t in self.shards[0].items()}]
        self.model = model.cuda().eval()

    @torch.no_grad()
    def logprobs(self, probe: ProbeBatch) -> list[list[float]]:
        """log p(token | prefix) (nats) of every probe token after its prompt."""
        out = []
        for seq, plen in zip(probe.sequences, probe.prompt_lens, strict=True):
            logits = self.model(input_ids=torch.tensor([seq], device="cuda")).logits[0].double()
            logp = torch.log_softmax(logits, dim=-1)
            out.append([float(logp[i - 1, seq[i]]) for i in range(plen, len(seq))])
        return out

    @torch.no_grad()
    def router_topk(self, tokens: list[int], top_k: int) -> torch.Tensor:
        """HF's routed experts `[positions, layers, top_k]` (sorted ids) of every position of `tokens`."""
        out = self.model(input_ids=torch.tensor([tokens], device="cuda"), output_router_logits=True)
        per_layer = [logits.float().topk(top_k, dim=-1).indices.sort(dim=-1).values for logits in out.router_logits]
        return torch.stack(per_layer, dim=1).cpu()


@dataclass
class MoeWorld:
    """The MoE server, the event loop its client lives on, the two policies (A served first, B pushed)."""

    root: Path
    a_dir: Path
    loop: EngineLoop
    engine: LaunchedEngine
    specs: list[ParamSpec]
    old: Policy
    new: Policy
    probe: ProbeBatch
    routing: RoutingLayout

    @property
    def fleet(self) -> list[FleetEngine]:
        return [FleetEngine(self.engine.client, EngineSpec(self.engine.client.engine_id, 1))]

    def scores(self) -> torch.Tensor:
        """The engine's probe log-probs, flattened (float64)."""
        rows = [self.loop.run(self.engine.client.score(list(s), p))
                for s, p in zip(self.probe.sequences, self.probe.prompt_lens, strict=True)]
        return torch.tensor([v for row in rows for v in row], dtype=torch.float64)

    def expected(self, policy: Policy) -> torch.Tensor:
        return torch.tensor([v for row in policy.logprobs(self.probe) for v in row], dtype=torch.float64)

    def verifier(self, policy: Policy) -> PushVerifier:
        return PushVerifier(self.loop, self.probe, policy.logprobs, max_probe_logp_diff=TOL)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MoeWorld]:
    root = tmp_path_factory.mktemp("qwen3-moe")
    a_dir = make_tiny_hf_model("qwen3_moe", MOE_SHAPE, VOCAB, root / "a", seed=0)
    args = {**SGLANG_TEST_ARGS, "enable_return_routed_experts": True}
    rollout = RolloutConfig(backend="sglang", engines=1, engine_tp=1, startup_timeout_s=STARTUP_S,
                            request_timeout_s=300.0, sglang_args=args)
    launcher = EngineLauncher(rollout, str(a_dir), str(root / "logs"))
    loop_thread = EventLoopThread("sglang-moe-gpu-test").start()
    engine: LaunchedEngine | None = None
    try:
        engine = loop_thread.run(launcher.start(0))
        from transformers import AutoModelForCausalLM

        layouts = moe_layouts(a_dir)
        old = Policy(AutoModelForCausalLM.from_pretrained(str(a_dir), dtype=torch.float32,
                                                          attn_implementation="eager"), layouts)
        new = Policy(build_tiny_hf_model("qwen3_moe", MOE_SHAPE, VOCAB, seed=1), layouts)
        routing = RoutingLayout.of_config(json.loads((a_dir / "config.json").read_text()))
        assert routing is not None
        yield MoeWorld(root=root, a_dir=Path(a_dir), loop=EngineLoop(loop_thread.loop, timeout_s=300.0),
                       engine=engine, specs=specs_from_layouts(layouts.values(), "float32"), old=old, new=new,
                       probe=make_probe(VOCAB, sequences=4, tokens=48, seed=0), routing=routing)
    finally:
        if engine is not None:
            loop_thread.run(launcher.stop(engine))
        loop_thread.stop()


def test_generates_with_hf_logprobs(world: MoeWorld) -> None:
    sampling = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    gen = world.loop.run(world.engine.client.generate(PROMPT, sampling))
    assert gen.finish_reason == "length" and len(gen.output_ids) == 16
    assert all(0 <= t < VOCAB for t in gen.output_ids)
    seq = PROMPT + list(gen.output_ids)
    want = torch.tensor(world.old.logprobs(ProbeBatch((tuple(seq),), (len(PROMPT),)))[0], dtype=torch.float64)
    diff = (torch.tensor(gen.output_logprobs, dtype=torch.float64) - want).abs()
    result("generate", tokens=len(gen.output_ids), diff_max=float(diff.max()))
    assert float(diff.max()) < TOL


def test_scores_match_hf_forward(world: MoeWorld) -> None:
    diff = (world.scores() - world.expected(world.old)).abs()
    result("score_vs_hf", diff_mean=float(diff.mean()), diff_max=float(diff.max()))
    assert float(diff.max()) < TOL
    # The probe tells the two random models apart by far more than the tolerance.
    assert float((world.expected(world.new) - world.expected(world.old)).abs().mean()) > 20 * TOL


def push_verified_and_restored(world: MoeWorld, transport: Any, name: str,
                               shards_of: Callable[[Policy], Callable[[], list[dict[str, torch.Tensor]]]]) -> None:
    """Push B through `transport` (verified by the probe, the engine then scores as HF does on B), then A back
    (the engine's log-probs return to what they were). `shards_of(policy)` arms the trainer side with a policy
    and returns the coordinator's shard source."""
    baseline = world.scores()
    sync = WeightSyncCoordinator(transport, world.loop, world.verifier(world.new))
    try:
        rep = sync.push(world.fleet, shards_of(world.new), f"{name}-b")
        assert rep.verify is not None and rep.verify.logp_diff_max < TOL
        pushed = world.scores()
        diff_new = (pushed - world.expected(world.new)).abs()
        result(f"{name}_push_b", transport=rep.push.transport, push_s=round(rep.push.total_seconds, 4),
               bytes=rep.push.bytes, diff_max=float(diff_new.max()), probe_diff_max=rep.verify.logp_diff_max)
        assert float(diff_new.max()) < TOL
        assert world.loop.run(world.engine.client.weight_version()) == f"{name}-b"
        sync.verifier = world.verifier(world.old)
        rep = sync.push(world.fleet, shards_of(world.old), f"{name}-a")
        assert rep.verify is not None and rep.verify.logp_diff_max < TOL
    finally:
        sync.close()
    restored = world.scores()
    result(f"{name}_restore", max_abs_diff=float((restored - baseline).abs().max()))
    assert float((restored - world.expected(world.old)).abs().max()) < TOL
    assert torch.allclose(restored, baseline, rtol=0.0, atol=1e-6)


def test_disk_push_changes_logprobs_and_restores(world: MoeWorld) -> None:
    """SGLang's own MoE loader reads the HF names of a safetensors directory."""
    transport = DiskTransport(world.specs, 1, world.root / "weights", world.loop, bucket_bytes=64 * MIB,
                              template_dir=world.a_dir)
    push_verified_and_restored(world, transport, "disk", lambda policy: lambda: policy.shards)


def test_plugin_push_writes_fused_moe(world: MoeWorld) -> None:
    """Shard mode: the weight-loader plugin copies each expert's blocks into SGLang's stacked `w13_weight` /
    `w2_weight` (gloo group with this process as the trainer rank)."""
    sender = InProcessSender()
    transport = DistributedTransport(world.specs, 1, world.loop, bucket_bytes=64 * MIB, mode="shard",
                                     backend="gloo", senders=sender, init_timeout_s=120.0)

    def arm(policy: Policy) -> Callable[[], list[dict[str, torch.Tensor]]]:
        sender.shards = policy.shards_gpu[0]
        return lambda: pytest.fail("shard mode gathers nothing")

    push_verified_and_restored(world, transport, "plugin", arm)


def test_ipc_push_writes_fused_moe(world: MoeWorld) -> None:
    """`direct` CUDA-IPC tensors: every expert of a layer stacked into the parameters SGLang holds."""
    transport = IpcTransport(world.specs, 1, world.loop, bucket_bytes=64 * MIB)
    push_verified_and_restored(world, transport, "ipc", lambda policy: lambda: policy.shards_gpu)


def test_returns_routed_experts(world: MoeWorld) -> None:
    sampling = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    gen = world.loop.run(world.engine.client.generate(PROMPT, sampling, return_routed_experts=True))
    assert gen.routed_experts is not None, "the engine answered without meta_info.routed_experts"
    layout, k = world.routing, MOE_SHAPE.num_experts_per_tok
    prompt_len, response_len = len(PROMPT), len(gen.output_ids)
    # The whole sequence but its last token: what the rollout's sample_ids expects.
    ids = layout.sample_ids(gen.routed_experts, prompt_len, response_len)
    assert ids.shape == (response_len - 1, len(layout.moe_layers), k)
    assert layout.moe_layers == tuple(range(MOE_SHAPE.num_layers))
    assert int(ids.min()) >= 0 and int(ids.max()) < MOE_SHAPE.num_experts
    flat = torch.from_numpy(gen.routed_experts.astype("int64")).reshape(prompt_len + response_len - 1,
                                                                         layout.num_hidden_layers, k)
    engine_sets = flat.sort(dim=-1).values
    hf_sets = world.old.router_topk(PROMPT + list(gen.output_ids), k)[: prompt_len + response_len - 1]
    agreement = float((engine_sets == hf_sets).all(dim=-1).double().mean())
    result("routed_experts", positions=int(flat.shape[0]), agreement=agreement)
    assert agreement >= MIN_ROUTER_AGREEMENT
    # Without the request field the answer carries none.
    plain = world.loop.run(world.engine.client.generate(PROMPT, sampling))
    assert plain.routed_experts is None
