"""Rollout throughput: `RolloutManager` over a real engine fleet vs raw SGLang (a bare concurrent client), same
requests, for each engine set-up in one process.

    python benchmarks/rollout_throughput.py [--backend sglang] [--requests 256,512] [--variants shipped,sglang-default]
        [--prompt-len 128] [--new-tokens 256] [--group-size 8] [--repeats 20] [--model-dir DIR] [--out FILE.json]

Each `--variants` entry starts one engine (`--backend sglang`: `python -m sglang.launch_server` through
`start_fleet` / `EngineLauncher`, bf16, on a random Qwen2.5-0.5B-shaped model or `--model-dir`; `reference` for
a CPU smoke run):

- `shipped`: `conf/rollout/sglang.yaml`'s flags plus what a run derives from them (`config/engine_launch.py`:
  decode CUDA graphs sized to the largest `--requests`), as `miles-lite train` launches it;
- `sglang-default`: `conf/rollout/sglang.yaml`'s flags alone (SGLang's own decode graph size);
- `no-graphs`: `--disable-cuda-graph` added.

For every request count N it then runs, alternately and `--repeats` times (one direct round first warms up):

- direct: N concurrent `HttpEngine.generate` calls (asyncio.gather) on the engine's client: raw SGLang;
- manager: `RolloutManager.generate_groups` on N / group_size prompts x group_size samples, with the fleet's
  default in-flight limit (the engine's capacity from `/get_server_info`, capped at its decode graph batch),

both with the same prompts (random token ids, `--prompt-len` long), `--new-tokens` new tokens, temperature 1,
`ignore_eos`. Reports generated tokens/s (median, min-max of the repeats) per variant, mode and N, and each
manager median over the best raw median at that N (any variant). Prints a markdown table; `--out` writes JSON
after every variant.
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

from miles_lite.config.engine_launch import with_decode_graphs
from miles_lite.config.schema import FaultToleranceConfig, RolloutConfig
from miles_lite.engines.fleet_launch import start_fleet
from miles_lite.net import startup_heap
from miles_lite.rollout.fleet import EngineFleet
from miles_lite.rollout.manager import RolloutManager
from miles_lite.trainer.tiny_hf import QWEN25_05B_SHAPE, QWEN25_VOCAB, make_tiny_hf_model
from miles_lite.types import SamplingParams

REPO = Path(__file__).resolve().parents[1]


@dataclass
class Run:
    """One timed pass: `requests` completions, `tokens` generated in `wall_s` seconds."""

    variant: str
    mode: str
    requests: int
    tokens: int
    wall_s: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s


VARIANTS = ("shipped", "sglang-default", "no-graphs")


def variant_rollout(variant: str, backend: str, requests: int, group_size: int, new_tokens: int,
                    startup_timeout: float) -> RolloutConfig:
    """The rollout config one engine of `variant` launches with (see the module docstring)."""
    import yaml

    if variant not in VARIANTS:
        raise ValueError(f"--variants: {variant!r} is none of {', '.join(VARIANTS)}")
    shipped = yaml.safe_load((REPO / "conf" / "rollout" / "sglang.yaml").read_text())["sglang_args"]
    args = {**shipped, "dtype": "bfloat16"} | ({"disable_cuda_graph": True} if variant == "no-graphs" else {})
    rollout = RolloutConfig(backend=backend, engines=1, engine_tp=1, group_size=group_size,
                            prompts_per_step=requests // group_size, max_new_tokens=new_tokens,
                            request_timeout_s=600.0, startup_timeout_s=startup_timeout,
                            sglang_args=args if backend == "sglang" else {},
                            reference_args={"max_batch_size": requests})
    return with_decode_graphs(rollout) if variant == "shipped" else rollout


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
    return Run("", "direct", len(gens), sum(len(g.output_ids) for g in gens), wall)


async def manager_pass(manager: RolloutManager, prompts: list[list[int]], group_size: int,
                       params: SamplingParams) -> Run:
    """The same requests as groups through the rollout manager."""
    start = time.perf_counter()
    groups = await manager.generate_groups([(i, p, None) for i, p in enumerate(prompts)], group_size, params)
    wall = time.perf_counter() - start
    samples = [s for g in groups for s in g.samples]
    return Run("", "manager", len(samples), sum(len(s.response_ids) for s in samples), wall)


def check(run: Run, requests: int, new_tokens: int) -> None:
    """ignore_eos: every request must have produced exactly `new_tokens` tokens."""
    if run.requests != requests or run.tokens != requests * new_tokens:
        raise RuntimeError(f"{run.mode} pass returned {run.requests} requests / {run.tokens} tokens, expected "
                           f"{requests} / {requests * new_tokens}")


async def measure_variant(variant: str, args: argparse.Namespace, sizes: list[int], model_dir: str,
                          log_dir: str) -> dict[str, Any]:
    """Start `variant`'s engine, run the passes at every size, stop it; its runs and start-up facts."""
    rollout = variant_rollout(variant, args.backend, max(sizes), args.group_size, args.new_tokens,
                              args.startup_timeout)
    ft = FaultToleranceConfig()
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, ignore_eos=True)
    started = time.perf_counter()
    fleet = await start_fleet(rollout, ft, model_dir, f"{log_dir}/{variant}", engines=1)
    startup_s = time.perf_counter() - started
    startup_heap.settle(collect=True)  # as `miles-lite train` once started: full collections skip the libraries
    manager = RolloutManager(fleet, rollout, ft)
    runs: list[Run] = []
    try:
        capacity = [r.capacity for r in fleet.records]
        print(f"{variant}: started in {startup_s:.1f} s, capacity {capacity}, args {rollout.sglang_args}", flush=True)
        for n in sizes:
            prompts = make_prompts(n // args.group_size, args.prompt_len, args.vocab, seed=n)
            check(await direct_pass(fleet, prompts, args.group_size, params), n, args.new_tokens)  # warm-up
            for _ in range(args.repeats):
                for run in (await direct_pass(fleet, prompts, args.group_size, params),
                            await manager_pass(manager, prompts, args.group_size, params)):
                    check(run, n, args.new_tokens)
                    run.variant = variant
                    runs.append(run)
                    print(f"  {variant:14s} {run.mode:8s} {n:4d} requests: {run.tokens_per_s:10,.0f} tok/s "
                          f"({run.wall_s:.2f} s)", flush=True)
    finally:
        await fleet.close()
    return {"variant": variant, "startup_s": startup_s, "engine_capacity": capacity,
            "sglang_args": rollout.sglang_args, "runs": runs}


def summarize(variants: list[dict[str, Any]], sizes: list[int]) -> list[dict[str, Any]]:
    """Median and min-max per variant, mode and size; each manager median over the best raw median at its size."""
    rows = []
    for v in variants:
        for n in sizes:
            row: dict[str, Any] = {"variant": v["variant"], "requests": n}
            for mode in ("direct", "manager"):
                rates = sorted(r.tokens_per_s for r in v["runs"] if r.requests == n and r.mode == mode)
                if rates:
                    row[f"{mode}_tok_s"] = statistics.median(rates)
                    row[f"{mode}_min_max"] = [rates[0], rates[-1]]
            rows.append(row)
    for n in sizes:
        best = max((r["direct_tok_s"] for r in rows if r["requests"] == n and "direct_tok_s" in r), default=None)
        for r in rows:
            if r["requests"] == n and best and "manager_tok_s" in r:
                r["manager_over_best_raw"] = r["manager_tok_s"] / best
    return rows


def build_report(args: argparse.Namespace, variants: list[dict[str, Any]], sizes: list[int]) -> dict[str, Any]:
    return {"backend": args.backend, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
            "group_size": args.group_size, "repeats": args.repeats, "rows": summarize(variants, sizes),
            "variants": [{**{k: v for k, v in var.items() if k != "runs"},
                          "runs": [asdict(r) | {"tokens_per_s": r.tokens_per_s} for r in var["runs"]]}
                         for var in variants]}


async def measure(args: argparse.Namespace, model_dir: str, log_dir: str) -> dict[str, Any]:
    """Every variant in turn; the JSON report (rewritten to `--out` after each variant)."""
    sizes = [int(s) for s in args.requests.split(",")]
    if any(n % args.group_size for n in sizes):
        raise ValueError(f"--requests {sizes} must all be multiples of --group-size {args.group_size}")
    done: list[dict[str, Any]] = []
    for variant in args.variants.split(","):
        done.append(await measure_variant(variant, args, sizes, model_dir, log_dir))
        if args.out:
            Path(args.out).write_text(json.dumps(build_report(args, done, sizes), indent=1))
    return build_report(args, done, sizes)


def main() -> None:
    startup_heap.pause()  # the driver's collector policy (`miles_lite.net.startup_heap`), settled once started
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="sglang", choices=("sglang", "reference"))
    parser.add_argument("--requests", default="256,512", help="comma-separated request counts per pass")
    parser.add_argument("--variants", default="shipped,sglang-default", help=f"engine set-ups, of {VARIANTS}")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--model-dir", default="", help="HF model directory (default: a random Qwen2.5-0.5B shape)")
    parser.add_argument("--vocab", type=int, default=QWEN25_VOCAB, help="prompt token ids are drawn below this")
    parser.add_argument("--startup-timeout", type=float, default=300.0)
    parser.add_argument("--out", default="", help="write the JSON report here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="rollout-throughput-") as tmp:
        model_dir = args.model_dir or str(make_tiny_hf_model("qwen2", QWEN25_05B_SHAPE, QWEN25_VOCAB,
                                                             Path(tmp) / "model", seed=0))
        report = asyncio.run(measure(args, model_dir, str(Path(args.out).parent / "engine-logs" if args.out
                                                          else Path(tmp) / "logs")))
    print(f"\n{args.prompt_len} prompt + {args.new_tokens} new tokens, group size {args.group_size}, median "
          f"(min-max) of {args.repeats} rounds; tokens/s")
    for var in report["variants"]:
        print(f"- {var['variant']}: start-up {var['startup_s']:.1f} s, capacity {var['engine_capacity']}")
    print("| variant | requests | raw SGLang (direct) | manager | manager / best raw |\n|---|---:|---:|---:|---:|")
    for row in report["rows"]:
        d, m = row.get("direct_min_max", [0, 0]), row.get("manager_min_max", [0, 0])
        print(f"| {row['variant']} | {row['requests']} | {row.get('direct_tok_s', 0):,.0f} ({d[0]:,.0f}-{d[1]:,.0f}) "
              f"| {row.get('manager_tok_s', 0):,.0f} ({m[0]:,.0f}-{m[1]:,.0f}) "
              f"| {row.get('manager_over_best_raw', float('nan')):.3f} |")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
