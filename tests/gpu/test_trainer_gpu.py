"""The trainer on a real GPU: TE spec log-probs vs HF transformers, RL steps in bf16 and every FP8
recipe, and FP8 SFT tracking bf16 on a learnable task (skipped without CUDA or TransformerEngine)."""

from __future__ import annotations

import math
import random
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]

from miles_lite.config.schema import MilesConfig, TinyModelShape  # noqa: E402
from miles_lite.config.views import ActorConfig  # noqa: E402
from miles_lite.data.permutation import permutation_batch  # noqa: E402
from miles_lite.types import TrainBatch  # noqa: E402

VOCAB = 4096
# Qwen2-style: QKV bias, tied embeddings, GQA; every GEMM dimension a multiple of 16 (FP8 needs it).
SHAPE = TinyModelShape(hidden_size=256, ffn_hidden_size=704, num_layers=4, num_attention_heads=4, num_kv_heads=2,
                       max_position_embeddings=4096, rope_theta=1_000_000.0, qkv_bias=True, tie_word_embeddings=True)


@pytest.fixture(scope="module", autouse=True)
def process_group() -> Iterator[None]:
    """One single-rank NCCL group for the module; the actors created in turn reuse it."""
    pytest.importorskip("transformer_engine")
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Qwen2 checkpoint with peaked logits (init std 0.05) saved as safetensors."""
    from miles_lite.trainer.tiny_hf import make_tiny_hf_model

    return make_tiny_hf_model("qwen2", SHAPE, VOCAB, tmp_path_factory.mktemp("qwen2"), seed=0, init_std=0.05)


def make_actor(path: Path, precision: str, recipe: str = "delayed", lr: float = 1e-5):  # noqa: ANN201
    from miles_lite.trainer.actor import TrainerActor

    cfg = MilesConfig()
    cfg.model.hf_path = str(path)
    t = cfg.trainer
    t.device, t.layer_spec, t.precision, t.fp8_recipe = "gpu", "te", precision, recipe
    t.micro_batch_tokens, t.logprob_chunk_tokens, t.lr = 4096, 512, lr
    cfg.algo.is_level, cfg.algo.is_mode = "token", "truncate"
    return TrainerActor(ActorConfig.of(cfg), 0, 1)


def ragged_batch(seed: int, n: int = 12, advantages: list[float] | None = None) -> TrainBatch:
    """Ragged sequences (40..300 tokens) whose total is not a multiple of 16; rollout log-probs -2."""
    rng = random.Random(seed)
    lengths = [rng.randint(40, 300) for _ in range(n)]
    if sum(lengths) % 16 == 0:
        lengths[0] += 1
    tokens = [[rng.randrange(VOCAB) for _ in range(m)] for m in lengths]
    plens = [rng.randint(1, 32) for _ in lengths]
    adv = advantages if advantages is not None else [1.0 if i % 2 == 0 else -1.0 for i in range(n)]
    return TrainBatch(tokens=tokens, prompt_lengths=plens,
                      rollout_logprobs=[[-2.0] * (m - p) for m, p in zip(lengths, plens, strict=True)],
                      advantages=adv)


def hf_logprobs(path: Path, batch: TrainBatch, dtype: torch.dtype) -> list[list[float]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, attn_implementation="sdpa").cuda().eval()
    out = []
    with torch.no_grad():
        for seq, plen in zip(batch.tokens, batch.prompt_lengths, strict=True):
            ids = torch.tensor([seq], device="cuda")
            logp = model(input_ids=ids).logits[0].float().log_softmax(-1)
            out.append(logp[plen - 1:-1].gather(-1, ids[0, plen:, None])[:, 0].cpu().tolist())
    return out


def abs_diffs(a: list[list[float]], b: list[list[float]]) -> torch.Tensor:
    return (torch.tensor([v for r in a for v in r]) - torch.tensor([v for r in b for v in r])).abs()


def mean_of(rows: list[list[float]], pick: list[int]) -> float:
    vals = [v for i in pick for v in rows[i]]
    return sum(vals) / len(vals)


@pytest.mark.parametrize(("precision", "mean_tol", "max_tol"), [("fp32", 2e-3, 2e-2), ("bf16", 5e-2, 0.5)])
def test_te_logprobs_match_hf(model_dir: Path, precision: str, mean_tol: float, max_tol: float) -> None:
    batch = ragged_batch(0, n=4)
    actor = make_actor(model_dir, precision)
    try:
        got = actor.compute_logprobs(batch)
    finally:
        actor.close()
    ref = hf_logprobs(model_dir, batch, torch.float32 if precision == "fp32" else torch.bfloat16)
    d = abs_diffs(got, ref)
    spread = torch.tensor([v for r in ref for v in r]).std()
    assert spread > 0.5, "the random model's log-probs should vary, or the comparison proves nothing"
    assert float(d.mean()) < mean_tol and float(d.max()) < max_tol, (float(d.mean()), float(d.max()))


@pytest.mark.parametrize(("precision", "recipe"), [("bf16", "delayed"), ("fp8", "delayed"), ("fp8", "tensorwise"),
                                                   ("fp8", "blockwise")])
def test_rl_steps_move_logprobs_by_advantage(model_dir: Path, precision: str, recipe: str) -> None:
    """Three GRPO/PPO steps on a packed ragged batch raise the positive-advantage sequences' log-probs
    relative to the negative ones, with finite losses and gradient norms."""
    batch = ragged_batch(1)
    pos, neg = list(range(0, 12, 2)), list(range(1, 12, 2))
    actor = make_actor(model_dir, precision, recipe, lr=3e-5)
    try:
        before = actor.compute_logprobs(batch)
        for _ in range(3):
            stats = actor.train_step(batch)
            assert stats["skipped"] == 0.0 and torch.isfinite(torch.tensor(stats["grad_norm"])), stats
        after = actor.compute_logprobs(batch)
    finally:
        actor.close()
    gain_pos = mean_of(after, pos) - mean_of(before, pos)
    gain_neg = mean_of(after, neg) - mean_of(before, neg)
    assert gain_pos > 0.0 > gain_neg, (gain_pos, gain_neg)


@pytest.mark.parametrize("recipe", ["delayed", "blockwise"])
def test_fp8_model_scores_in_bf16_when_unquantized(model_dir: Path, recipe: str) -> None:
    """`quantized=False` (the weight-push probe) gives an FP8 model the bf16 model's log-probs; the FP8
    forward differs from both, and the FP8 forward still runs afterwards."""
    batch = ragged_batch(2, n=4)
    bf16 = make_actor(model_dir, "bf16")
    try:
        want = bf16.compute_logprobs(batch)
    finally:
        bf16.close()
    fp8 = make_actor(model_dir, "fp8", recipe)
    try:
        quantized = fp8.compute_logprobs(batch)
        unquantized = fp8.compute_logprobs(batch, quantized=False)
        again = fp8.compute_logprobs(batch)
        assert fp8.policy.model.config.fp8 is not None
    finally:
        fp8.close()
    assert float(abs_diffs(unquantized, want).max()) < 1e-2, float(abs_diffs(unquantized, want).max())
    assert float(abs_diffs(quantized, want).mean()) > 10 * float(abs_diffs(unquantized, want).mean())
    assert float(abs_diffs(again, quantized).max()) < 1e-3


def sft_losses(path: Path, precision: str, steps: int, lr: float) -> list[float]:
    actor = make_actor(path, precision, "delayed", lr=lr)
    try:
        return [actor.sft_step(permutation_batch(VOCAB, 16, 64, s), lr=lr)["loss/sft"] for s in range(steps)]
    finally:
        actor.close()


def test_fp8_sft_tracks_bf16(model_dir: Path) -> None:
    """30 SFT steps: both precisions learn the task, and FP8's loss stays within 0.3 nats (or 10%) of bf16's."""
    bf16 = sft_losses(model_dir, "bf16", 30, 3e-4)
    fp8 = sft_losses(model_dir, "fp8", 30, 3e-4)
    assert bf16[-1] < 0.25 * bf16[0] and fp8[-1] < 0.25 * fp8[0], (bf16, fp8)
    for step, (a, b) in enumerate(zip(bf16, fp8, strict=True)):
        assert abs(a - b) <= max(0.3, 0.1 * a), (step, a, b)


def _main_ratio(before: list[torch.Tensor], after: list[torch.Tensor]) -> float:
    delta = sum(float((a.double() - b.double()).square().sum()) for a, b in zip(after, before, strict=True))
    return (delta / sum(float(b.double().square().sum()) for b in before)) ** 0.5


@pytest.mark.parametrize(("precision", "recipe"), [("bf16", "delayed"), ("fp8", "tensorwise")])
def test_divergence_guard_bounds_steps_and_undoes_exactly(model_dir: Path, precision: str, recipe: str) -> None:
    """On the GPU optimizer (TransformerEngine's fused Adam): ordinary steps are cleared by the guard's bound
    (no snapshot) and move the main params by no more than it; a step at an exploding learning rate is
    measured, undone from the host snapshot, and leaves main params, Adam state, step counters and the
    model's weights bit for bit as they were."""
    from miles_lite.trainer.guard import _is_adam

    batch = ragged_batch(2)
    actor = make_actor(model_dir, precision, recipe, lr=3e-5)
    try:
        guard = actor.guard
        assert guard is not None and all(_is_adam(o) for o in guard._torch_optimizers())
        for _ in range(3):
            main = [p.detach().clone() for p in guard._main_params()]
            stats = actor.train_step(batch)
            assert stats["skipped"] == 0.0 and "update_ratio" not in stats, stats
            assert 0 < _main_ratio(main, [p.detach() for p in guard._main_params()]) <= stats["update_ratio_bound"]
        assert guard.snapshots_taken == 0

        main = [p.detach().clone() for p in guard._main_params()]
        state = [{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in o.state[p].items()}
                 for o in guard._torch_optimizers() for g in o.param_groups for p in g["params"]]
        groups = [{k: v for k, v in g.items() if k != "params"} for o in guard._torch_optimizers()
                  for g in o.param_groups]
        model = {n: p.detach().clone() for n, p in actor.policy.model.named_parameters()}
        # A learning rate off by orders of magnitude, from the schedule (every RL step sets the schedule's rate).
        actor.scheduler.get_lr = lambda param_group: 1e3
        groups = [{**g, "lr": 1e3} for g in groups]
        stats = actor.train_step(batch)
        assert stats["skipped"] == 1.0 and stats["update_ratio"] > 0.5, stats
        assert stats["update_ratio"] <= stats["update_ratio_bound"]
        assert guard.snapshots_taken == 1
        for a, b in zip(main, guard._main_params(), strict=True):
            assert torch.equal(a, b.detach())
        live = [o.state[p] for o in guard._torch_optimizers() for g in o.param_groups for p in g["params"]]
        for saved, now in zip(state, live, strict=True):
            assert saved.keys() == now.keys()
            for k, v in saved.items():
                assert torch.equal(v, now[k]) if isinstance(v, torch.Tensor) else v == now[k], k
        assert groups == [{k: v for k, v in g.items() if k != "params"} for o in guard._torch_optimizers()
                          for g in o.param_groups]
        for n, p in actor.policy.model.named_parameters():
            assert torch.equal(model[n], p.detach()), n
    finally:
        actor.close()


def test_offload_round_trip_keeps_training_bit_identical_on_the_gpu(model_dir: Path) -> None:
    """The hand-off on a GPU: every part offloaded, then onloaded with the copies in flight (they run on the
    offload's stream; the step waits for them on the device), trains exactly as a trainer that never moved."""
    from miles_lite.config.offload import OFFLOAD_PARTS

    runs = {}
    for moved in (True, False):
        actor = make_actor(model_dir, "bf16")
        try:
            stats = [actor.train_step(ragged_batch(1))]
            if moved:
                off = actor.offload(OFFLOAD_PARTS)
                assert off["params_bytes"] > 0 and off["optimizer_bytes"] > 0
                assert actor.memory_stats()["trainer_state_bytes"] == 0.0
                actor.onload(OFFLOAD_PARTS)  # returns with the copies queued, not done
            stats.append(actor.train_step(ragged_batch(2)))
            runs[moved] = (stats, actor.compute_logprobs(ragged_batch(3)))
        finally:
            actor.close()
    # Equal up to the GPU's own run-to-run rounding (atomics in some backward kernels); a step that read the
    # optimizer state before its copy landed would move the weights by whole learning rates instead.
    (moved_stats, moved_lp), (still_stats, still_lp) = runs[True], runs[False]
    for key in ("loss/total", "grad_norm"):
        assert [s[key] for s in moved_stats] == pytest.approx([s[key] for s in still_stats], rel=1e-3), key
    diff = max(abs(a - b) for ra, rb in zip(moved_lp, still_lp, strict=True) for a, b in zip(ra, rb, strict=True))
    assert diff < 1e-2, diff


def test_a_deferred_offload_frees_only_when_settled_and_round_trips_exactly(model_dir: Path) -> None:
    """The offload a weight push overlaps: the optimizer state's copies queued on the offload's stream, its
    device memory held until `finish_offload` and freed there; onloaded, every tensor is what it was, bit for bit.
    Without the room asked for, the same call completes before it returns."""
    from miles_lite.trainer.offload import OverlapRoom, PartState

    actor = make_actor(model_dir, "bf16")
    try:
        actor.train_step(ragged_batch(1))
        off = actor.offloader

        def state() -> list[torch.Tensor]:
            return [t.detach().cpu() for t in (*off.collectors["optimizer"](), *actor.policy.model.parameters())]

        before = state()
        torch.cuda.synchronize()
        moved = actor.offload(("grads", "optimizer"), OverlapRoom(weights_scale=1.0, staging_bytes=0))
        assert moved["deferred"] == 1.0 and moved["optimizer_bytes"] > 0 and moved["grads_bytes"] > 0
        assert off.states["optimizer"] is PartState.LEAVING and off.states["grads"] is PartState.OFFLOADED
        held = torch.cuda.memory_allocated()
        assert actor.finish_offload()["seconds"] >= 0.0
        assert off.states["optimizer"] is PartState.OFFLOADED
        assert held - torch.cuda.memory_allocated() >= moved["optimizer_bytes"]
        actor.onload(("grads", "optimizer"))
        off.require_resident(("optimizer",), "comparing the state")
        after = state()
        assert len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after, strict=True))

        # No room: the copies land and the memory goes before the call returns.
        held = torch.cuda.memory_allocated()
        moved = actor.offload(("grads", "optimizer"), OverlapRoom(weights_scale=1.0, staging_bytes=1 << 60))
        assert moved["deferred"] == 0.0 and off.states["optimizer"] is PartState.OFFLOADED
        assert held - torch.cuda.memory_allocated() >= moved["optimizer_bytes"]
        actor.onload(("grads", "optimizer"))
        stats = actor.train_step(ragged_batch(2))
        assert math.isfinite(stats["loss/total"]) and math.isfinite(stats["grad_norm"])
    finally:
        actor.close()


def test_a_write_after_the_staged_offload_copies_are_dropped_waits_for_them() -> None:
    """A hand-off keeping its state stages it for a save, then drops the copies after the push (no offload takes
    them): the copies run on the offload's stream, so the next write of the state, on the compute stream, must
    wait for them or the save would write the new values. 1 GiB takes tens of milliseconds to copy out; the write
    half a millisecond."""
    from miles_lite.trainer.offload import TrainerOffload

    big = torch.arange(1 << 28, dtype=torch.int32, device="cuda")
    off = TrainerOffload({"params": lambda: [big], "grads": lambda: [], "optimizer": lambda: []})
    torch.cuda.synchronize()
    off.stage(("params",))
    staged = off.staged_copies()(big)
    assert staged is not None and staged[1] is not None  # queued on the offload's stream, with its event
    off.drop_staged(("params",))
    big.fill_(-1)
    torch.cuda.synchronize()
    host = staged[0]
    assert host[0].item() == 0 and host[-1].item() == (1 << 28) - 1
    assert torch.equal(host[:: 1 << 16], torch.arange(0, 1 << 28, 1 << 16, dtype=torch.int32))
