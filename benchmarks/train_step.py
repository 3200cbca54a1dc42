"""Trainer step throughput, FP8-vs-bf16 learning curves and TE-vs-HF log-prob agreement.

    python benchmarks/train_step.py --out results.json                       # GPU: Qwen2.5-0.5B shape
    python benchmarks/train_step.py --shape tiny --configs fp32 --steps 2    # anywhere (CPU: local spec)
    python benchmarks/train_step.py --guard --steps 20 --configs bf16        # the divergence guard's cost
    python benchmarks/train_step.py --bare --configs bf16 --batch 512 --seq 480 --prompt-tokens 224 \
        --steps 20                                # the GSM8K recipe's batch: 512 short sequences

Throughput: `TrainerActor.train_step` (GRPO advantages, PPO-clip loss, token-level IS correction
against the batch's rollout log-probs) on a fixed 8 x 2048 batch and on a packed batch of ragged
sequences, for each `--configs` entry (bf16, fp8-delayed, fp8-tensorwise, fp8-blockwise, fp32).
`--bare` also times a plain megatron-core language-model step (labels through `GPTModel`, same
model, DDP and optimizer, the fixed batch's tokens as BSHD rows, `--micro-batch-tokens` of them per
forward and backward) so the RL path's overhead is measured in the same process. `--transformer
KEY=VALUE` passes a TransformerConfig field through (`trainer.transformer`), to both steps. Model
FLOPs count the matmuls and causal attention once (no recomputation): 6 * (matmul params) * tokens
+ 6 * layers * heads * head_dim * sum(s_i^2). MFU is against the H200's dense bf16 peak (989 TFLOP/s)
for every precision.

`--guard` times the RL step instead with the divergence guard as shipped, without it, and undoing every
step (its fallback path), interleaved on one trainer: step time min/median/max, peak GPU memory of each, and
`on_cost` (goal <= 0.02) / `on_extra_mem_frac` (goal <= 0.05).

`--sft-steps N` trains bf16 and each FP8 recipe N SFT steps from the same weights on a learnable
synthetic task (each response token is a fixed permutation of the previous one) and reports the
loss curves. `--agreement` compares response log-probs of the TE model and of the HF transformers
model on the same weights and tokens, in fp32 and bf16.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import socket
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from step_timing import profile_steps, summarize, time_interleaved, time_steps  # this directory: scripts

from miles_lite.config.schema import MilesConfig, TinyModelShape
from miles_lite.config.views import ActorConfig
from miles_lite.data.permutation import permutation_batch
from miles_lite.data.tokenizer import load_or_build_tokenizer
from miles_lite.trainer import cpu_compat
from miles_lite.trainer.actor import TrainerActor
from miles_lite.trainer.guard import UpdateGuard
from miles_lite.trainer.model import HFModelSpec, spec_from_hf_config
from miles_lite.trainer.tiny_hf import QWEN25_05B_SHAPE, QWEN25_VOCAB, make_tiny_hf_model
from miles_lite.types import TrainBatch

TINY = TinyModelShape(hidden_size=128, ffn_hidden_size=352, num_layers=2, num_attention_heads=4, num_kv_heads=2,
                      max_position_embeddings=4096)
# Qwen2.5-7B's width (hidden 3584, SwiGLU 18944, 28 heads, 4 KV groups, untied 152064 vocabulary), 6 of its 28
# layers: the per-layer GEMM shapes of the real model at a size one GPU steps quickly.
QWEN25_7B_WIDTH_6L = TinyModelShape(hidden_size=3584, ffn_hidden_size=18944, num_layers=6, num_attention_heads=28,
                                    num_kv_heads=4, max_position_embeddings=32768, rope_theta=1_000_000.0,
                                    rms_norm_eps=1e-6, tie_word_embeddings=False, qkv_bias=True)
# The whole Qwen2.5-7B: the same width, all 28 layers.
QWEN25_7B = dataclasses.replace(QWEN25_7B_WIDTH_6L, num_layers=28)
SHAPES = {"qwen2.5-0.5b": (QWEN25_05B_SHAPE, QWEN25_VOCAB), "tiny": (TINY, 1024),
          "qwen2.5-7b-w6": (QWEN25_7B_WIDTH_6L, 152064), "qwen2.5-7b": (QWEN25_7B, 152064)}


@dataclass(frozen=True)
class RunConfig:
    """One precision setting: `precision` fp32|bf16|fp8 and the FP8 recipe (when fp8)."""

    name: str
    precision: str
    fp8_recipe: str = "delayed"

    @staticmethod
    def parse(name: str) -> RunConfig:
        """`bf16`, `fp32` or `fp8-<recipe>`; raises ValueError naming the flag otherwise."""
        if name in ("bf16", "fp32"):
            return RunConfig(name, name)
        if name.startswith("fp8-") and name[4:] in ("delayed", "tensorwise", "blockwise"):
            return RunConfig(name, "fp8", name[4:])
        raise ValueError(f"--configs entry {name!r} is not bf16, fp32 or fp8-delayed|tensorwise|blockwise")


def make_model_dir(shape_name: str, root: Path, init_std: float) -> Path:
    """Save a random HF Qwen2 model of `shape_name` under `root` once (reused when present).

    The offline tokenizer goes beside the weights, so the directory is a complete checkpoint that
    the driver accepts as `model.hf_path`.
    """
    shape, vocab = SHAPES[shape_name]
    out = root / f"{shape_name}-std{init_std}"
    if not (out / "config.json").is_file():
        make_tiny_hf_model("qwen2", shape, vocab, out, seed=0, init_std=init_std)
    if not (out / "tokenizer.json").is_file():
        load_or_build_tokenizer(root / ".tokenizers").save_pretrained(str(out))
    return out


def actor_config(model_dir: Path, run: RunConfig, device: str, micro_batch_tokens: int, lr: float,
                 logprob: dict[str, Any] | None = None, transformer: dict[str, Any] | None = None) -> ActorConfig:
    """A single-rank trainer configuration for `run` on `device` (gpu: TE spec; cpu: local spec).

    `logprob`: `trainer.logprob_*` overrides (chunk_tokens, recompute, kernel); `transformer`:
    `trainer.transformer` (TransformerConfig fields).
    """
    cfg = MilesConfig()
    cfg.model.hf_path = str(model_dir)
    t = cfg.trainer
    t.device = device
    t.layer_spec = "te" if device == "gpu" else "local"
    t.precision, t.fp8_recipe = run.precision, run.fp8_recipe
    t.micro_batch_tokens = micro_batch_tokens
    t.lr, t.clip_grad = lr, 1.0
    cfg.algo.advantage_estimator, cfg.algo.policy_loss = "grpo", "ppo"
    cfg.algo.is_level, cfg.algo.is_mode = "token", "truncate"
    for key, value in (logprob or {}).items():
        setattr(t, f"logprob_{key}", value)
    t.transformer = dict(transformer or {})
    return ActorConfig.of(cfg)


def rl_batch(lengths: list[int], prompt_lengths: list[int], vocab: int, seed: int, group: int = 8) -> TrainBatch:
    """Random tokens; rollout log-probs in [-4, 0]; GRPO advantages of random 0/1 rewards per group."""
    rng = random.Random(seed)
    tokens = [[rng.randrange(vocab) for _ in range(n)] for n in lengths]
    lps = [[-4.0 * rng.random() for _ in range(n - p)] for n, p in zip(lengths, prompt_lengths, strict=True)]
    adv: list[float] = []
    for g in range(0, len(lengths), group):
        rewards = [float(rng.random() < 0.5) for _ in lengths[g:g + group]]
        mean = sum(rewards) / len(rewards)
        std = (sum((r - mean) ** 2 for r in rewards) / len(rewards)) ** 0.5
        adv.extend((r - mean) / (std + 1e-6) for r in rewards)
    return TrainBatch(tokens=tokens, prompt_lengths=list(prompt_lengths), rollout_logprobs=lps, advantages=adv)


def fixed_batch(vocab: int, n: int, length: int, prompt: int | None = None) -> TrainBatch:
    """`n` sequences of `length` tokens, `prompt` of each (default: a quarter) the prompt."""
    prompt = length // 4 if prompt is None else prompt
    if not 1 <= prompt < length:
        raise ValueError(f"--prompt-tokens must be in [1, --seq), got {prompt} for --seq {length}")
    return rl_batch([length] * n, [prompt] * n, vocab, seed=1)


def packed_batch(vocab: int, total: int, max_len: int) -> TrainBatch:
    """Ragged sequences (64..max_len tokens, prompts 16..256) totalling about `total` tokens, not a multiple of 16."""
    rng = random.Random(2)
    lengths: list[int] = []
    while sum(lengths) < total - 64:
        lengths.append(min(rng.randint(64, max_len), total - sum(lengths)))
    if sum(lengths) % 16 == 0:
        lengths[-1] -= 3
    prompts = [min(rng.randint(16, 256), n // 2) for n in lengths]
    return rl_batch(lengths, prompts, vocab, seed=3)


def step_flops(spec: HFModelSpec, lengths: list[int]) -> float:
    """Model FLOPs of one training step (forward + backward = 3x forward) over sequences of `lengths`."""
    h, d, nq, nkv = spec.hidden_size, spec.head_dim, spec.num_attention_heads, spec.num_kv_heads
    per_layer = h * (nq + 2 * nkv) * d + nq * d * h + 3 * h * spec.ffn_hidden_size
    matmul = spec.num_layers * per_layer + spec.vocab_size * h
    tokens = sum(lengths)
    # Causal attention: QK^T and PV, 2 FLOPs per MAC, s(s+1)/2 query-key pairs per sequence.
    attn = spec.num_layers * 2 * 2 * nq * d * sum(s * (s + 1) / 2 for s in lengths)
    return 3.0 * (2.0 * matmul * tokens + attn)


def bare_lm_step(actor: TrainerActor, ids: torch.Tensor, micro_batch_tokens: int) -> float:
    """One plain megatron-core LM step on `[b, s]` ids with the actor's model, DDP and optimizer, rows
    grouped into micro-batches of at most `micro_batch_tokens` (at least one row); returns the mean loss."""
    ddp, dev = actor.ddp, actor.policy.device
    ids = ids.to(dev)
    rows = max(1, micro_batch_tokens // ids.shape[1])
    pos = torch.arange(ids.shape[1], device=dev).unsqueeze(0)
    mask = None
    if actor.policy.runtime.layer_spec == "local":
        # The local spec takes 3-row (multimodal) RoPE positions and an explicit causal mask.
        pos = pos.unsqueeze(0).expand(3, -1, -1)
        mask = ~torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool, device=dev).tril()[None, None]
    losses = []
    with cpu_compat.device_mode():
        actor.policy.model.train()
        # As the RL step does: TE quantizes the FP8 weights again at the first micro-batch (their cast is part of
        # a step's cost), instead of reusing the copies the last RL step made of weights it has since updated.
        actor.policy.model.set_is_first_microbatch()
        ddp.zero_grad_buffer()
        actor.optimizer.zero_grad()
        for mb in ids.split(rows):
            labels = torch.roll(mb, -1, dims=1)
            mb_pos = pos.expand(*pos.shape[:-2], mb.shape[0], -1)
            loss = ddp(input_ids=mb, position_ids=mb_pos, attention_mask=mask, labels=labels).float().mean()
            (loss * (mb.shape[0] / ids.shape[0])).backward()
            losses.append(loss.detach() * mb.shape[0])
        actor._finalize_grads([ddp])
        actor.optimizer.step()
    return float(torch.stack(losses).sum()) / ids.shape[0]


def parse_transformer(items: list[str]) -> dict[str, Any]:
    """`--transformer KEY=VALUE` flags -> TransformerConfig fields (values read as YAML: true, 2, 1e-5, full)."""
    import yaml

    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--transformer takes KEY=VALUE (e.g. apply_rope_fusion=true), got {item!r}")
        out[key] = yaml.safe_load(value)
    return out


def throughput(args: argparse.Namespace, model_dir: Path, run: RunConfig, device: str) -> dict[str, Any]:
    """Fixed and packed RL steps (and the bare LM step with --bare) for one precision setting."""
    spec = spec_from_hf_config(model_dir)
    logprob = {"chunk_tokens": args.logprob_chunk_tokens, "recompute": args.logprob_recompute,
               "kernel": args.logprob_kernel}
    transformer = parse_transformer(args.transformer)
    actor = TrainerActor(actor_config(model_dir, run, device, args.micro_batch_tokens, 1e-6, logprob, transformer),
                         0, 1)
    out: dict[str, Any] = {"logprob": logprob, "transformer": transformer}
    try:
        batches = {"fixed": fixed_batch(spec.vocab_size, args.batch, args.seq, args.prompt_tokens)}
        if args.packed:
            batches["packed"] = packed_batch(spec.vocab_size, args.batch * args.seq, args.seq)
        if args.bare:
            ids = torch.tensor(batches["fixed"].tokens)
            fixed = batches.pop("fixed")
            last_rl: dict[str, float] = {}
            fns = {"rl": lambda: last_rl.update(actor.train_step(fixed)),
                   "bare": lambda: bare_lm_step(actor, ids, args.micro_batch_tokens)}
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()
            times = time_interleaved(fns, args.warmup, args.steps)
            flops = step_flops(spec, [ids.shape[1]] * ids.shape[0])
            out["fixed"] = summarize(times["rl"], fixed.num_tokens, flops)
            out["fixed"].update(loss=last_rl.get("loss/total"), grad_norm=last_rl.get("grad_norm"))
            out["bare_fixed"] = summarize(times["bare"], ids.numel(), flops)
            if torch.cuda.is_available():
                out["peak_mem_gib_rl_and_bare"] = torch.cuda.max_memory_allocated() / 2**30
            out["rl_over_bare"] = out["bare_fixed"]["step_s"] / out["fixed"]["step_s"]
            out["rl_over_bare_per_round"] = sorted(b / r for r, b in zip(times["rl"], times["bare"], strict=True))
            if args.profile:
                tables = profile_steps(fns, args.profile / f"{run.name}{args.tag}")
                out["profile_dir"] = str(args.profile / f"{run.name}{args.tag}")
                for name, table in tables.items():
                    print(f"--- profile {run.name} {name} (2 steps) ---\n" + "\n".join(table.splitlines()[:24]),
                          flush=True)
        for name, batch in batches.items():
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()
            last: dict[str, float] = {}

            def step(b: TrainBatch = batch, sink: dict[str, float] = last) -> None:
                sink.update(actor.train_step(b))

            times = time_steps(step, args.warmup, args.steps)
            lengths = [len(t) for t in batch.tokens]
            res = summarize(times, batch.num_tokens, step_flops(spec, lengths))
            res.update(sequences=len(lengths), tokens=batch.num_tokens, loss=last.get("loss/total"),
                       grad_norm=last.get("grad_norm"), skipped=last.get("skipped"))
            if torch.cuda.is_available():
                res["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
            out[name] = res
        # Cost of the per-step finiteness check alone (grads are still in the buffers after the last step).
        fin = time_steps(lambda: actor._all_finite([]), 1, 3)
        out["finite_check_ms"] = 1e3 * sorted(fin)[1]
    finally:
        actor.close()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return out



def guard_cost(args: argparse.Namespace, model_dir: Path, run: RunConfig, device: str) -> dict[str, Any]:
    """The RL step with the divergence guard as shipped (`on`: `trainer.max_update_ratio=0.5`; `measured`: its
    step that measures the weights' norms, one in 50), without it (`off`) and with a limit no step meets
    (`undo`: every step snapshotted, measured and undone, the path of a step the guard's bound cannot clear),
    interleaved round by round on one trainer; step time min/median/max and peak GPU memory of each, and the
    cost of `on` against `off`."""
    spec = spec_from_hf_config(model_dir)
    actor = TrainerActor(actor_config(model_dir, run, device, args.micro_batch_tokens, 1e-6), 0, 1)
    try:
        shipped = actor.guard
        if shipped is None:
            raise RuntimeError("the trainer was built without its divergence guard (trainer.max_update_ratio=0)")
        undo = UpdateGuard(actor.optimizer, 1e-12)
        # The shipped guard measures the weights' norms every 50 steps and carries them in between: `measured`
        # is its step that measures them (every step here), `on` what the steps in between cost.
        measured = UpdateGuard(actor.optimizer, shipped.max_ratio)
        actor.cfg.trainer.max_diverged_skips = 10**9  # undone steps are the point here, not a reason to stop
        batch = fixed_batch(spec.vocab_size, args.batch, args.seq, args.prompt_tokens)
        peaks: dict[str, float] = {}
        last: dict[str, dict[str, float]] = {}

        def variant(name: str, guard: UpdateGuard | None, measure: bool = False) -> Any:
            def step() -> None:
                actor.guard = guard
                if guard is not None and measure:
                    guard.invalidate()
                if torch.cuda.is_available():
                    torch.cuda.reset_peak_memory_stats()
                last[name] = actor.train_step(batch)
                if torch.cuda.is_available():
                    peaks[name] = max(peaks.get(name, 0.0), torch.cuda.max_memory_allocated() / 2**30)
            return step

        times = time_interleaved({"off": variant("off", None), "on": variant("on", shipped),
                                  "measured": variant("measured", measured, measure=True),
                                  "undo": variant("undo", undo)}, args.warmup, args.steps)
        flops = step_flops(spec, [args.seq] * args.batch)
        out: dict[str, Any] = {name: summarize(t, batch.num_tokens, flops) for name, t in times.items()}
        out["on_cost"] = out["on"]["step_s"] / out["off"]["step_s"] - 1  # goal: <= 0.02
        out["on_cost_per_round"] = sorted(on / off - 1 for on, off in zip(times["on"], times["off"], strict=True))
        out["measured_cost"] = out["measured"]["step_s"] / out["off"]["step_s"] - 1
        out["measured_cost_per_round"] = sorted(m / off - 1 for m, off in zip(times["measured"], times["off"],
                                                                              strict=True))
        out["undo_cost"] = out["undo"]["step_s"] / out["off"]["step_s"] - 1
        out["snapshots_taken_on"] = shipped.snapshots_taken  # 0: the bound cleared every step
        out["update_ratio_bound_on"] = last["on"].get("update_ratio_bound")
        out["skipped_undo"] = last["undo"].get("skipped")
        if peaks:
            out["peak_mem_gib"] = peaks
            out["on_extra_mem_frac"] = peaks["on"] / peaks["off"] - 1  # goal: <= 0.05
        return out
    finally:
        actor.close()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def sft_curve(model_dir: Path, run: RunConfig, device: str, steps: int, lr: float) -> list[float]:
    """Per-step SFT loss (nats/token) of `steps` steps on the permutation task from the saved weights."""
    vocab = spec_from_hf_config(model_dir).vocab_size
    actor = TrainerActor(actor_config(model_dir, run, device, 8192, lr), 0, 1)
    try:
        return [actor.sft_step(permutation_batch(vocab, 16, 64, s), lr=lr)["loss/sft"] for s in range(steps)]
    finally:
        actor.close()


def hf_response_logprobs(model_dir: Path, batch: TrainBatch, dtype: torch.dtype, device: str) -> list[list[float]]:
    """Response-token log-probs (fp32 log-softmax of the HF logits) under transformers' own forward."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, attn_implementation="sdpa")
    model = model.to("cuda" if device == "gpu" else "cpu").eval()
    out = []
    with torch.no_grad():
        for seq, plen in zip(batch.tokens, batch.prompt_lengths, strict=True):
            ids = torch.tensor([seq], device=model.device)
            logp = model(input_ids=ids).logits[0].float().log_softmax(-1)
            tgt = ids[0, plen:]
            out.append(logp[plen - 1:-1].gather(-1, tgt[:, None])[:, 0].cpu().tolist())
    del model
    return out


def diff_stats(a: list[list[float]], b: list[list[float]]) -> dict[str, float]:
    """Per-token mean and max |a - b| over ragged rows."""
    x = torch.tensor([v for row in a for v in row], dtype=torch.float64)
    y = torch.tensor([v for row in b for v in row], dtype=torch.float64)
    d = (x - y).abs()
    return {"mean_abs_diff": float(d.mean()), "max_abs_diff": float(d.max()), "tokens": int(d.numel())}


def agreement(model_dir: Path, device: str) -> dict[str, Any]:
    """TE (or local-spec) trainer log-probs vs HF transformers on the same weights, fp32 and bf16."""
    vocab = spec_from_hf_config(model_dir).vocab_size
    batch = rl_batch([512, 384, 256, 200], [1, 1, 1, 1], vocab, seed=5)
    hf = {p: hf_response_logprobs(model_dir, batch, dt, device)
          for p, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16))}
    out: dict[str, Any] = {"hf_fp32_mean_logp": sum(map(sum, hf["fp32"])) / sum(map(len, hf["fp32"]))}
    for prec in ("fp32", "bf16"):
        try:
            actor = TrainerActor(actor_config(model_dir, RunConfig.parse(prec), device, 8192, 1e-6), 0, 1)
        except Exception as err:  # a precision the installed TE cannot run is a result, not a crash
            out[f"trainer_{prec}"] = {"error": f"{type(err).__name__}: {err}"[:400]}
            continue
        try:
            lp = actor.compute_logprobs(batch)
        finally:
            actor.close()
        out[f"trainer_{prec}_vs_hf_{prec}"] = diff_stats(lp, hf[prec])
        if prec == "bf16":
            out["trainer_bf16_vs_hf_fp32"] = diff_stats(lp, hf["fp32"])
    out["hf_bf16_vs_hf_fp32"] = diff_stats(hf["bf16"], hf["fp32"])
    return out


def init_process_group(device: str) -> None:
    """One single-rank process group for the whole run; actors created in turn reuse it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl" if device == "gpu" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=0, world_size=1)


def main(argv: list[str] | None = None) -> int:
    """Run the selected measurements; print one JSON line per result and write them all to --out."""
    gpu = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-0.5b" if gpu else "tiny")
    p.add_argument("--model-root", type=Path, default=Path("/tmp/miles-bench-models"))
    p.add_argument("--configs", default="bf16,fp8-delayed,fp8-tensorwise,fp8-blockwise" if gpu else "fp32")
    p.add_argument("--batch", type=int, default=8, help="sequences of the fixed batch")
    p.add_argument("--seq", type=int, default=2048, help="tokens per sequence of the fixed batch")
    p.add_argument("--prompt-tokens", type=int, default=None, help="prompt tokens per sequence (default: seq / 4)")
    p.add_argument("--transformer", action="append", default=[], metavar="KEY=VALUE",
                   help="a TransformerConfig field for both steps (trainer.transformer); repeatable")
    p.add_argument("--micro-batch-tokens", type=int, default=16384)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--bare", action="store_true",
                   help="also time a plain megatron-core LM step, alternating with the RL step on the same tokens")
    p.add_argument("--packed", action="store_true", help="also time the RL step on a packed ragged batch")
    p.add_argument("--profile", type=Path, default=None,
                   help="with --bare: write torch profiler traces of 2 RL and 2 bare steps under this directory")
    p.add_argument("--logprob-chunk-tokens", type=int, default=2048, help="trainer.logprob_chunk_tokens")
    p.add_argument("--logprob-recompute", action="store_true", help="trainer.logprob_recompute=true")
    p.add_argument("--logprob-kernel", default="auto", choices=("auto", "compiled", "eager"),
                   help="trainer.logprob_kernel")
    p.add_argument("--tag", default="", help="suffix of the result keys (several runs into one --out)")
    p.add_argument("--sft-steps", type=int, default=0, help="FP8-vs-bf16 SFT curves of this many steps")
    p.add_argument("--sft-lr", type=float, default=1e-4)
    p.add_argument("--sft-configs", default="", help="FP8 recipes of the SFT curves (default: those of --configs)")
    p.add_argument("--agreement", action="store_true", help="trainer vs HF log-probs, fp32 and bf16")
    p.add_argument("--guard", action="store_true",
                   help="time the RL step with the divergence guard on / off / undoing every step, interleaved")
    p.add_argument("--init-std", type=float, default=0.02)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    device = "gpu" if gpu else "cpu"
    runs = [RunConfig.parse(c) for c in args.configs.split(",") if c]
    init_process_group(device)
    results: dict[str, Any] = {"device": torch.cuda.get_device_name() if gpu else "cpu", "shape": args.shape,
                               "torch": torch.__version__}
    model_dir = make_model_dir(args.shape, args.model_root, args.init_std)

    def record(key: str, fn: Any) -> None:
        t0 = time.perf_counter()
        try:
            results[key] = fn()
        except Exception as err:  # keep the other measurements when one configuration fails
            results[key] = {"error": f"{type(err).__name__}: {err}"[:600], "trace": traceback.format_exc()[-1500:]}
        print(json.dumps({key: results[key], "wall_s": round(time.perf_counter() - t0, 1)}), flush=True)
        if args.out:
            args.out.write_text(json.dumps(results, indent=1))

    for run in runs:
        if args.guard:
            record(f"guard/{run.name}{args.tag}", lambda r=run: guard_cost(args, model_dir, r, device))
        else:
            record(f"throughput/{run.name}{args.tag}", lambda r=run: throughput(args, model_dir, r, device))
    if args.sft_steps:
        # Every FP8 recipe against the bf16 baseline (on CPU: the fp32 curve alone).
        base = RunConfig.parse("bf16" if gpu else "fp32")
        sft_runs = [RunConfig.parse(c) for c in args.sft_configs.split(",") if c] if args.sft_configs else runs
        for run in [base, *(r for r in sft_runs if r.precision == "fp8")]:
            record(f"sft/{run.name}", lambda r=run: sft_curve(model_dir, r, device, args.sft_steps, args.sft_lr))
    if args.agreement:
        record("agreement", lambda: agreement(make_model_dir(args.shape, args.model_root, 0.05), device))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
