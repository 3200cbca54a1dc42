"""Rollout host overhead on CPU: `RolloutManager` vs a bare concurrent client against a fake SGLang server.

    python benchmarks/rollout_host_overhead.py [--requests 256,512] [--latency-s 1.0] [--repeats 10]
        [--new-tokens 256] [--prompt-len 128] [--group-size 8] [--profile FILE.pstats] [--out FILE.json]

The server (a subprocess: the engine's CPU is not the client's) answers SGLang 0.5.17's `/generate` JSON for
token-id requests (`output_ids`, `meta_info` with `output_token_logprobs` = [[logprob, id, null], ...],
`finish_reason`, `completion_tokens`, ...) exactly `--latency-s` after each request arrived, whatever else it
is doing, like a GPU engine whose batch decodes in a fixed time. A request sent late, or an answer read late
because the client's event loop is busy, therefore shows up as wall time, as it does on the GPU.

Each round runs `direct_pass` and `manager_pass` of `benchmarks/rollout_throughput.py` (same prompts, same
fleet, health checks on, as that benchmark runs them) and records, per pass: the wall time, tokens/s, the
client's CPU seconds, the spread of arrivals at the server (first to last request received: a late send), the
lag of the last arrival after the pass started, and the garbage collector's pauses during the pass.
`--profile` writes a cProfile of the manager passes (open with `python -m pstats`).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parent))

from rollout_throughput import check, direct_pass, make_prompts, manager_pass  # noqa: E402

from miles_lite.config.schema import FaultToleranceConfig, RolloutConfig  # noqa: E402
from miles_lite.net import startup_heap  # noqa: E402
from miles_lite.rollout.fleet import EngineFleet, EngineHandle  # noqa: E402
from miles_lite.rollout.http_client import HttpEngine  # noqa: E402
from miles_lite.rollout.manager import RolloutManager  # noqa: E402
from miles_lite.types import SamplingParams  # noqa: E402

VOCAB = 151_936


# ------------------------------------------------------------------------------------------------ fake server

class FakeSGLang:
    """SGLang's `/generate` answers for token-id requests, each `latency_s` after its arrival."""

    def __init__(self, latency_s: float) -> None:
        self.latency_s = latency_s
        self.arrivals: list[float] = []
        self.count = 0

    def answer(self, body: dict[str, Any], arrived: float) -> dict[str, Any]:
        ids = body["input_ids"]
        sp = body.get("sampling_params") or {}
        n = int(sp.get("max_new_tokens", 16))
        self.count += 1
        base = self.count * 7919 + len(ids)
        out = [(base + i * 104_729) % VOCAB for i in range(n)]
        # SGLang's logprobs are float32 values printed as Python floats: ~18 characters each.
        logprobs = [-((t % 1000) + 1) / 1234.5678901 for t in out]
        meta: dict[str, Any] = {
            "id": body.get("rid") or f"{self.count:032x}",
            "finish_reason": {"type": "length", "length": n},
            "prompt_tokens": len(ids),
            "weight_version": "default",
            "total_retractions": 0,
            "completion_tokens": n,
            "cached_tokens": 0,
            "e2e_latency": self.latency_s,
        }
        if body.get("return_logprob"):
            meta["input_token_logprobs"] = [[None, ids[-1], None]]
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(logprobs, out, strict=True)]
        return {"output_ids": out, "meta_info": meta}

    async def generate(self, request: web.Request) -> web.Response:
        arrived = time.monotonic()
        self.arrivals.append(arrived)
        body = json.loads(await request.read())
        # Encoded now, so that the answer leaves at its due time rather than after the server's own work.
        text = json.dumps(self.answer(body, arrived))
        await asyncio.sleep(max(0.0, arrived + self.latency_s - time.monotonic()))  # the simulated decode time
        return web.Response(text=text, content_type="application/json")

    async def arrivals_since(self, request: web.Request) -> web.Response:
        """The arrival times (time.monotonic, system-wide) recorded since the last call; clears them."""
        taken, self.arrivals = self.arrivals, []
        return web.json_response(taken)

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response({"model_path": "fake", "weight_version": "default", "is_generation": True})

    async def server_info(self, request: web.Request) -> web.Response:
        # No capacity limit below the largest pass: the fleet then sends every request at once, as on the GPU.
        return web.json_response({"max_running_requests": 4096, "weight_version": "default"})

    async def abort(self, request: web.Request) -> web.Response:
        return web.Response(text="")


async def serve(latency_s: float) -> None:
    fake = FakeSGLang(latency_s)
    app = web.Application(client_max_size=64 << 20)
    app.add_routes([web.post("/generate", fake.generate), web.get("/health_generate", fake.health),
                    web.get("/health", fake.health), web.get("/model_info", fake.model_info),
                    web.get("/get_server_info", fake.server_info), web.post("/abort_request", fake.abort),
                    web.get("/_arrivals", fake.arrivals_since)])
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, backlog=4096)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    print(port, flush=True)  # the parent's readiness signal: the socket listens from here on
    await asyncio.Event().wait()


@contextmanager
def fake_server(latency_s: float) -> Iterator[str]:
    """A fake SGLang server subprocess; yields its URL once it listens."""
    proc = subprocess.Popen([sys.executable, __file__, "--serve", "--latency-s", str(latency_s)],
                            stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        if not line.strip().isdigit():
            raise RuntimeError(f"fake server did not start (exit {proc.poll()}): {line!r}")
        yield f"http://127.0.0.1:{int(line)}"
    finally:
        proc.terminate()
        proc.wait(10)


# ------------------------------------------------------------------------------------------------- measuring

@dataclass
class Pass:
    mode: str
    requests: int
    wall_s: float
    tokens_per_s: float
    cpu_s: float
    send_spread_s: float
    last_arrival_s: float
    gc_pauses: int
    gc_pause_s: float
    gc_max_s: float
    gc_full: int


class GcTimer:
    """Pauses of the cyclic garbage collector (gc.callbacks) between `reset` calls."""

    def __init__(self) -> None:
        self.pauses: list[tuple[int, float]] = []
        self._start = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.pauses.append((info["generation"], time.perf_counter() - self._start))

    def reset(self) -> list[tuple[int, float]]:
        """(generation, seconds) of every collection since the last call."""
        taken, self.pauses = self.pauses, []
        return taken


async def measure(args: argparse.Namespace, url: str) -> dict[str, Any]:
    ft = FaultToleranceConfig()
    sizes = [int(s) for s in args.requests.split(",")]
    rollout = RolloutConfig(backend="sglang", engines=1, group_size=args.group_size,
                            prompts_per_step=max(sizes) // args.group_size, max_new_tokens=args.new_tokens,
                            request_timeout_s=600.0)
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, ignore_eos=True)
    fleet = EngineFleet(ft, max_inflight_per_engine=rollout.max_inflight_per_engine)
    client = HttpEngine("engine-0", url, request_timeout_s=rollout.request_timeout_s, vocab_size=VOCAB)
    await fleet.add_engine(EngineHandle(client))
    fleet.start_health_checks()
    manager = RolloutManager(fleet, rollout, ft)
    if not args.keep_gc:
        startup_heap.settle(collect=True)  # as `miles-lite train` once started (`miles_lite.net.startup_heap`)
    gc_timer = GcTimer()
    gc.callbacks.append(gc_timer)
    profiler = cProfile.Profile() if args.profile else None
    passes: list[Pass] = []
    modes = args.modes.split(",")

    async def arrivals() -> list[float]:
        async with aiohttp.ClientSession() as session, session.get(f"{url}/_arrivals") as resp:
            return await resp.json()

    async def timed(mode: str, n: int, prompts: list[list[int]]) -> Pass:
        await arrivals()
        gc_timer.reset()
        cpu, start = time.process_time(), time.monotonic()
        if mode == "direct":
            run = await direct_pass(fleet, prompts, args.group_size, params)
        else:
            if profiler is not None:
                profiler.enable()
            try:
                run = await manager_pass(manager, prompts, args.group_size, params)
            finally:
                if profiler is not None:
                    profiler.disable()
        cpu = time.process_time() - cpu
        check(run, n, args.new_tokens)
        collections = gc_timer.reset()
        pauses = [t for _, t in collections]
        got = sorted(t for t in await arrivals() if t >= start)
        return Pass(mode, n, run.wall_s, run.tokens_per_s, cpu, got[-1] - got[0], got[-1] - start, len(pauses),
                    sum(pauses), max(pauses, default=0.0), sum(g == 2 for g, _ in collections))

    try:
        for n in sizes:
            prompts = make_prompts(n // args.group_size, args.prompt_len, VOCAB, seed=n)
            for mode in modes:  # warm-up: connections, caches
                await timed(mode, n, prompts)
            for _ in range(args.repeats):
                for mode in modes:
                    p = await timed(mode, n, prompts)
                    passes.append(p)
                    print(f"  {mode:8s} {n:4d}: {p.tokens_per_s:9,.0f} tok/s wall {p.wall_s:.3f} s cpu {p.cpu_s:.3f} s "
                          f"spread {p.send_spread_s * 1e3:6.1f} ms last-arrival {p.last_arrival_s * 1e3:6.1f} ms "
                          f"gc {p.gc_pauses} x ({p.gc_pause_s * 1e3:.1f} ms, max {p.gc_max_s * 1e3:.1f}, "
                          f"full {p.gc_full})",
                          flush=True)
    finally:
        gc.callbacks.remove(gc_timer)
        await fleet.close()
    if profiler is not None:
        profiler.dump_stats(args.profile)
    return {"latency_s": args.latency_s, "new_tokens": args.new_tokens, "prompt_len": args.prompt_len,
            "group_size": args.group_size, "repeats": args.repeats, "rows": summarize(passes, sizes, args.latency_s),
            "passes": [asdict(p) for p in passes]}


def summarize(passes: list[Pass], sizes: list[int], latency_s: float) -> list[dict[str, Any]]:
    rows = []
    for n in sizes:
        row: dict[str, Any] = {"requests": n}
        for mode in ("direct", "manager"):
            ps = [p for p in passes if p.requests == n and p.mode == mode]
            if not ps:
                continue
            med = {k: statistics.median(getattr(p, k) for p in ps)
                   for k in ("wall_s", "tokens_per_s", "cpu_s", "send_spread_s", "last_arrival_s", "gc_pause_s")}
            row[mode] = med | {"max_wall_s": max(p.wall_s for p in ps), "overhead_s": med["wall_s"] - latency_s,
                               "cpu_us_per_request": med["cpu_s"] / n * 1e6}
        if "direct" in row and "manager" in row:
            row["manager_over_direct"] = row["manager"]["tokens_per_s"] / row["direct"]["tokens_per_s"]
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # the fake server's own process
    parser.add_argument("--requests", default="256,512")
    parser.add_argument("--latency-s", type=float, default=1.0, help="each request's time in the fake engine")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--modes", default="direct,manager", help="passes of each round, in order")
    parser.add_argument("--profile", default="", help="write a cProfile of the manager passes here")
    parser.add_argument("--keep-gc", action="store_true",
                        help="leave the collector as it is (default: the driver's policy, the start-up heap frozen)")
    parser.add_argument("--out", default="", help="write the JSON report here")
    args = parser.parse_args()
    if not args.keep_gc and not args.serve:
        startup_heap.pause()
    if args.serve:
        asyncio.run(serve(args.latency_s))
        return
    with fake_server(args.latency_s) as url:
        report = asyncio.run(measure(args, url))
    print(f"\nfake engine latency {args.latency_s} s; {args.prompt_len} prompt + {args.new_tokens} new tokens, "
          f"group size {args.group_size}; medians of {args.repeats} rounds")
    print("| requests | mode | tok/s | wall s (max) | wall - latency ms | send spread ms | client CPU us/request "
          "| GC ms |\n|---:|---|---:|---:|---:|---:|---:|---:|")
    for row in report["rows"]:
        for mode in ("direct", "manager"):
            if mode not in row:
                continue
            m = row[mode]
            cells = [f"{m['tokens_per_s']:,.0f}", f"{m['wall_s']:.3f} ({m['max_wall_s']:.3f})",
                     f"{m['overhead_s'] * 1e3:.1f}", f"{m['send_spread_s'] * 1e3:.1f}",
                     f"{m['cpu_us_per_request']:.0f}", f"{m['gc_pause_s'] * 1e3:.1f}"]
            print(f"| {row['requests']} | {mode} | {' | '.join(cells)} |")
        ratio = row.get("manager_over_direct", float("nan"))
        print(f"| {row['requests']} | manager / direct | {ratio:.3f} | | | | | |")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
