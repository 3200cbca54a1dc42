"""Rollout throughput: `RolloutManager` over a real engine fleet vs a bare concurrent client, same requests.

    python benchmarks/rollout_throughput.py [--backend sglang] [--requests 64,256] [--prompt-len 128]
        [--new-tokens 256] [--group-size 8] [--repeats 3] [--model-dir DIR] [--out FILE.json]

Starts one engine (`--backend sglang`: `python -m sglang.launch_server` with `conf/rollout/sglang.yaml`'s
flags (prefill CUDA graphs off) plus `--dtype bfloat16`, through `start_fleet` / `EngineLauncher`; decode
CUDA graphs stay on, as in training; `--no-cuda-graph` turns them off; `reference` for a CPU smoke run)
on a random Qwen2.5-0.5B-shaped model
(`tiny_hf.make_tiny_hf_model`, or `--model-dir`), then for each request count N runs, alternately and `--repeats` times:

- direct: N concurrent `HttpEngine.generate` calls (asyncio.gather) on the fleet's engine client;
- manager: `RolloutManager.generate_groups` on N / group_size prompts x group_size samples, with the
  fleet's default in-flight limit (the engine's own capacity, from `/get_server_info`),

both with the same prompts (random token ids, `--prompt-len` long), `--new-tokens` new tokens, temperature 1,
`ignore_eos` (every request produces exactly `--new-tokens` tokens). One direct round of each size warms the
engine up first (kernel compilation). Reports generated tokens/s (generated tokens over wall seconds, median
of the repeats) per mode and the ratio manager / direct. Prints a markdown table; `--out` writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from miles_lite.config.schema import FaultToleranceConfig, RolloutConfig
from miles_lite.engines.fleet_launch import start_fleet
from miles_lite.rollout.fleet import EngineFleet
from miles_lite.rollout.manager import RolloutManager
from miles_lite.trainer.tiny_hf import QWEN25_05B_SHAPE, QWEN25_VOCAB, make_tiny_hf_model
from miles_lite.types import SamplingParams

REPO = Path(__file__).resolve().parents[1]


@dataclass
class Run:
    """One timed pass: `requests` completions, `tokens` generated in `wall_s` seconds."""

    mode: str
    requests: int
    tokens: int
    wall_s: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s


def sglang_args(cuda_graph: bool = True) -> dict[str, Any]:
    """`conf/rollout/sglang.yaml`'s sglang_args (prefill CUDA graphs off, as shipped) plus bf16 weights."""
    import yaml

    cfg = yaml.safe_load((REPO / "conf" / "rollout" / "sglang.yaml").read_text())
    return {**cfg["sglang_args"], "disable_cuda_graph": not cuda_graph, "dtype": "bfloat16"}


def make_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """`n` prompts of `length` random token ids in [0, vocab)."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(n)]


async def direct_pass(fleet: EngineFleet, prompts: list[list[int]], group_size: int, params: SamplingParams) -> Run:
    """Every prompt `group_size` times, all requests at once, straight to the engine client."""
    engine = fleet.records[0].engine
    start = time.perf_counter()
    gens = await asyncio.gather(*(engine.generate(p, params) for p in prompts for _ in range(group_size)))
    wall = time.perf_counter() - start
    return Run("direct", len(gens), sum(len(g.output_ids) for g in gens), wall)


async def manager_pass(manager: RolloutManager, prompts: list[list[int]], group_size: int,
                       params: SamplingParams) -> Run:
    """The same requests as groups through the rollout manager."""
    start = time.perf_counter()
    groups = await manager.generate_groups([(i, p, None) for i, p in enumerate(prompts)], group_size, params)
    wall = time.perf_counter() - start
    samples = [s for g in groups for s in g.samples]
    return Run("manager", len(samples), sum(len(s.response_ids) for s in samples), wall)


def check(run: Run, requests: int, new_tokens: int) -> None:
    """ignore_eos: every request must have produced exactly `new_tokens` tokens."""
    if run.requests != requests or run.tokens != requests * new_tokens:
        raise RuntimeError(f"{run.mode} pass returned {run.requests} requests / {run.tokens} tokens, expected "
                           f"{requests} / {requests * new_tokens}")


async def measure(args: argparse.Namespace, model_dir: str, log_dir: str) -> dict[str, Any]:
    """Start the fleet, run the passes, stop the fleet; returns the JSON report."""
    sizes = [int(s) for s in args.requests.split(",")]
    if any(n % args.group_size for n in sizes):
        raise ValueError(f"--requests {sizes} must all be multiples of --group-size {args.group_size}")
    rollout = RolloutConfig(backend=args.backend, engines=1, engine_tp=1, group_size=args.group_size,
                            max_new_tokens=args.new_tokens, request_timeout_s=600.0,
                            startup_timeout_s=args.startup_timeout,
                            sglang_args=sglang_args(not args.no_cuda_graph) if args.backend == "sglang" else {},
                            reference_args={"max_batch_size": max(sizes)})
    ft = FaultToleranceConfig()
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, ignore_eos=True)
    started = time.perf_counter()
    fleet = await start_fleet(rollout, ft, model_dir, log_dir, engines=1)
    startup_s = time.perf_counter() - started
    manager = RolloutManager(fleet, rollout, ft)
    capacity = [r.capacity for r in fleet.records]
    runs: list[Run] = []
    try:
        for n in sizes:
            prompts = make_prompts(n // args.group_size, args.prompt_len, args.vocab, seed=n)
            check(await direct_pass(fleet, prompts, args.group_size, params), n, args.new_tokens)  # warm-up
            for _ in range(args.repeats):
                for run in (await direct_pass(fleet, prompts, args.group_size, params),
                            await manager_pass(manager, prompts, args.group_size, params)):
                    check(run, n, args.new_tokens)
                    runs.append(run)
                    print(f"  {run.mode:8s} {n:4d} requests: {run.tokens_per_s:10,.0f} tok/s ({run.wall_s:.2f} s)",
                          flush=True)
    finally:
        await fleet.close()
    rows = []
    for n in sizes:
        per = {mode: sorted(r.tokens_per_s for r in runs if r.requests == n and r.mode == mode)
               for mode in ("direct", "manager")}
        med = {mode: statistics.median(v) for mode, v in per.items()}
        rows.append({"requests": n, "direct_tok_s": med["direct"], "manager_tok_s": med["manager"],
                     "direct_min_max": [per["direct"][0], per["direct"][-1]],
                     "manager_min_max": [per["manager"][0], per["manager"][-1]],
                     "ratio": med["manager"] / med["direct"]})
    return {"backend": args.backend, "startup_s": startup_s, "engine_capacity": capacity,
            "cuda_graph": not args.no_cuda_graph, "prompt_len": args.prompt_len,
            "new_tokens": args.new_tokens, "group_size": args.group_size, "repeats": args.repeats,
            "rows": rows, "runs": [asdict(r) | {"tokens_per_s": r.tokens_per_s} for r in runs]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="sglang", choices=("sglang", "reference"))
    parser.add_argument("--requests", default="64,256,512", help="comma-separated request counts per pass")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model-dir", default="", help="HF model directory (default: a random Qwen2.5-0.5B shape)")
    parser.add_argument("--vocab", type=int, default=QWEN25_VOCAB, help="prompt token ids are drawn below this")
    parser.add_argument("--startup-timeout", type=float, default=300.0)
    parser.add_argument("--no-cuda-graph", action="store_true", help="start SGLang with --disable-cuda-graph")
    parser.add_argument("--out", default="", help="write the JSON report here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="rollout-throughput-") as tmp:
        model_dir = args.model_dir or str(make_tiny_hf_model("qwen2", QWEN25_05B_SHAPE, QWEN25_VOCAB,
                                                             Path(tmp) / "model", seed=0))
        report = asyncio.run(measure(args, model_dir, str(Path(args.out).parent / "engine-logs" if args.out
                                                          else Path(tmp) / "logs")))
    print(f"\nstartup {report['startup_s']:.1f} s; engine capacity {report['engine_capacity']}; {args.prompt_len} "
          f"prompt + {args.new_tokens} new tokens, group size {args.group_size}, median (min-max) of {args.repeats}")
    print("| requests | direct tok/s | manager tok/s | manager / direct |\n|---:|---:|---:|---:|")
    for row in report["rows"]:
        d, m = row["direct_min_max"], row["manager_min_max"]
        print(f"| {row['requests']} | {row['direct_tok_s']:,.0f} ({d[0]:,.0f}-{d[1]:,.0f}) "
              f"| {row['manager_tok_s']:,.0f} ({m[0]:,.0f}-{m[1]:,.0f}) | {row['ratio']:.3f} |")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
