"""Trainer-vs-engine log-prob parity: the mismatch floor the importance-sampling metrics are judged against.

    python benchmarks/logprob_parity.py --engine-env PYTHONPATH=/opt/sglang-site --out parity.json      # GPU
    python benchmarks/logprob_parity.py --backend reference --shape tiny --precisions fp32            # CPU

For each precision (fp32, bf16): one engine (SGLang, or the CPU reference engine) serves a random
HF checkpoint in that dtype and samples completions of random prompts (temperature 1, `ignore_eos`),
returning the log-prob of every sampled token as rollouts do (decode). The same engine then scores
the full sequences in one prefill (`logprob_start_len`), the engine is stopped, and the Megatron
trainer (TE spec on GPU, in the same precision, weights converted from the same checkpoint) computes
the log-probs of the same tokens. HF transformers in fp32 is the common anchor. Reported per pair:
per-token mean and max |logp diff| over all completion tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from train_step import (
    SHAPES,
    RunConfig,
    actor_config,
    diff_stats,
    hf_response_logprobs,
    init_process_group,
    make_model_dir,
)

from miles_lite.config.schema import RolloutConfig
from miles_lite.engines.launcher import EngineLauncher
from miles_lite.trainer.actor import TrainerActor
from miles_lite.types import SamplingParams, TrainBatch

REPO = Path(__file__).resolve().parents[1]
SGLANG_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def engine_config(backend: str, precision: str, timeout_s: float) -> RolloutConfig:
    """One engine serving the checkpoint in `precision` (SGLang: `conf/rollout/sglang.yaml`'s flags, no CUDA graphs)."""
    if backend == "reference":
        return RolloutConfig(backend="reference", engines=1, startup_timeout_s=timeout_s)
    import yaml

    base = yaml.safe_load((REPO / "conf" / "rollout" / "sglang.yaml").read_text())["sglang_args"]
    args = {**base, "dtype": SGLANG_DTYPES[precision], "mem_fraction_static": 0.3, "base_gpu_id": 0,
            "disable_cuda_graph": True,  # the shipped config already turns prefill graphs off
            # sgl_kernel's fused RMSNorm has no fp32 kernel; deterministic inference uses torch-native ops.
            "enable_deterministic_inference": precision == "fp32"}
    return RolloutConfig(backend="sglang", engines=1, startup_timeout_s=timeout_s, sglang_args=args)


Rows = list[list[float]]


async def engine_logprobs(rollout: RolloutConfig, model_dir: Path, env: dict[str, str], prompts: list[list[int]],
                          new_tokens: int, log_dir: str) -> tuple[TrainBatch, Rows, Rows, float]:
    """Sample completions (decode log-probs), then score the full sequences (prefill log-probs)."""
    launcher = EngineLauncher(rollout, str(model_dir), log_dir, env=env)
    t0 = time.perf_counter()
    engine = await launcher.start(0)
    startup_s = time.perf_counter() - t0
    try:
        params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, ignore_eos=True, seed=0)
        gens = await asyncio.gather(*(engine.client.generate(p, params) for p in prompts))
        tokens = [p + list(g.output_ids) for p, g in zip(prompts, gens, strict=True)]
        decode = [list(g.output_logprobs) for g in gens]
        prefill = list(await asyncio.gather(*(engine.client.score(t, len(p))
                                              for t, p in zip(tokens, prompts, strict=True))))
    finally:
        await launcher.stop(engine)
    batch = TrainBatch(tokens=tokens, prompt_lengths=[len(p) for p in prompts],
                       rollout_logprobs=decode, advantages=[0.0] * len(tokens))
    return batch, decode, prefill, startup_s


def parity(args: argparse.Namespace, model_dir: Path, precision: str, env: dict[str, str]) -> dict[str, Any]:
    """All pairwise diffs for one precision."""
    vocab = SHAPES[args.shape][1]
    rng = random.Random(0)
    prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(args.sequences)]
    rollout = engine_config(args.backend, precision, args.startup_timeout)
    with tempfile.TemporaryDirectory(prefix="parity-logs-") as logs:
        batch, decode, prefill, startup_s = asyncio.run(
            engine_logprobs(rollout, model_dir, env, prompts, args.new_tokens, logs))
    device = "gpu" if torch.cuda.is_available() else "cpu"
    actor = TrainerActor(actor_config(model_dir, RunConfig.parse(precision), device, 16384, 1e-6), 0, 1)
    try:
        trainer = actor.compute_logprobs(batch)
    finally:
        actor.close()
    hf = hf_response_logprobs(model_dir, batch, torch.float32, device)
    return {
        "engine_startup_s": startup_s,
        "trainer_vs_engine_decode": diff_stats(trainer, decode),
        "trainer_vs_engine_prefill": diff_stats(trainer, prefill),
        "engine_prefill_vs_decode": diff_stats(prefill, decode),
        "trainer_vs_hf_fp32": diff_stats(trainer, hf),
        "engine_decode_vs_hf_fp32": diff_stats(decode, hf),
        "mean_logp": sum(map(sum, trainer)) / sum(map(len, trainer)),
    }


def main(argv: list[str] | None = None) -> int:
    gpu = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=("sglang", "reference"), default="sglang" if gpu else "reference")
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-0.5b" if gpu else "tiny")
    p.add_argument("--precisions", default="fp32,bf16" if gpu else "fp32")
    p.add_argument("--init-std", type=float, default=0.05, help="weight init std of the random checkpoint")
    p.add_argument("--sequences", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--engine-env", action="append", default=[], metavar="KEY=VALUE",
                   help="environment of the engine process (e.g. PYTHONPATH of a separate SGLang install)")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--model-root", type=Path, default=Path("/tmp/miles-bench-models"))
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    env = dict(kv.split("=", 1) for kv in args.engine_env)
    model_dir = make_model_dir(args.shape, args.model_root, args.init_std)
    init_process_group("gpu" if gpu else "cpu")
    results: dict[str, Any] = {"backend": args.backend, "shape": args.shape, "sequences": args.sequences,
                               "prompt_len": args.prompt_len, "new_tokens": args.new_tokens}
    for precision in args.precisions.split(","):
        results[precision] = parity(args, model_dir, precision, env)
        print(json.dumps({precision: results[precision]}), flush=True)
        if args.out:
            args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
