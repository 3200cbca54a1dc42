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

For every request count N it then runs, alternately, until `--repeats` rounds are complete (one direct round
first warms up):

- direct: N concurrent `HttpEngine.generate` calls (asyncio.gather) on the engine's client: raw SGLang;
- manager: `RolloutManager.generate_groups` on N / group_size prompts x group_size samples, with the fleet's
  default in-flight limit (the engine's capacity from `/get_server_info`, capped at its decode graph batch),

both with the same prompts (random token ids, `--prompt-len` long), `--new-tokens` new tokens, temperature 1,
`ignore_eos`. Reports generated tokens/s (median, min-max of the complete rounds: both passes done) per variant,
mode and N, and each manager median over the best raw median at that N (any variant). Prints a markdown table;
`--out` writes JSON after every round.

A pass the engine fails (`EngineError`; the manager's `RolloutError` / `FleetExhausted` once its retries are
spent) does not end the benchmark: it is recorded (variant, N, round, mode, error, seconds into the pass), the
engine's processes are described (each one's open descriptors and open-files limits, and the benchmark's own),
the engine is given up to 60 s to answer its health check again, and the next round runs (the failed one does not
count). A size is given up after 3 failed passes, a variant when its engine does not answer again. When the
engine fails a health check during a pass (the fleet replaces it after two), the Python stacks of its processes
are taken with py-spy before the fleet acts (`stack_dumps` in the report; py-spy is one of SGLang's
dependencies): what a stalled scheduler was doing.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from engine_processes import (  # this directory
    describe_processes,
    dump_stacks,
    engine_pids,
    find_py_spy,
    print_processes,
)

from miles_lite.config.engine_launch import with_decode_graphs
from miles_lite.config.schema import FaultToleranceConfig, RolloutConfig
from miles_lite.engines.fleet_launch import start_fleet
from miles_lite.net import startup_heap
from miles_lite.rollout.engine import EngineError
from miles_lite.rollout.fleet import EngineFleet, FleetExhausted
from miles_lite.rollout.manager import RolloutManager
from miles_lite.rollout.slots import RolloutError
from miles_lite.trainer.tiny_hf import QWEN25_05B_SHAPE, QWEN25_VOCAB, make_tiny_hf_model
from miles_lite.types import SamplingParams

REPO = Path(__file__).resolve().parents[1]
MODES = ("direct", "manager")
# Failed passes at one size after which the benchmark goes on to the next size.
MAX_FAILED_PASSES = 3
# Seconds an engine that failed a pass is given to answer its health check again.
RECOVERY_S = 60.0
# What a pass may raise when its engine fails it: the client's error, or the manager's once its retries are spent.
ENGINE_FAILURES = (EngineError, RolloutError, FleetExhausted)
# Seconds between looks at the engine's failed health checks during a pass.
HEALTH_POLL_S = 0.25


@dataclass
class Run:
    """One timed pass: `requests` completions, `tokens` generated in `wall_s` seconds; `round` of its size (1..)."""

    variant: str
    mode: str
    requests: int
    tokens: int
    wall_s: float
    round: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s


@dataclass
class Failure:
    """A pass its engine failed: where (`round` 0: the warm-up), the error, seconds into the pass; the processes
    then (`describe_processes`); seconds until the engine answered again (None: not within RECOVERY_S), and
    whether what answered was a replacement the fleet started."""

    variant: str
    requests: int
    round: int
    mode: str
    error: str
    after_s: float
    processes: list[dict[str, Any]] = field(default_factory=list)
    recovered_s: float | None = None
    replaced: bool = False


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


async def direct_pass(fleet: EngineFleet, prompts: list[list[int]], group_size: int, params: SamplingParams,
                      on_error: Callable[[], object] | None = None) -> Run:
    """Every prompt `group_size` times, all requests at once, straight to the engine client. When one fails,
    `on_error` runs while the others are still in flight, then they are cancelled."""
    engine = fleet.records[0].engine
    start = time.perf_counter()
    tasks = [asyncio.ensure_future(engine.generate(p, params)) for p in prompts for _ in range(group_size)]
    try:
        gens = await asyncio.gather(*tasks)
    except BaseException:
        if on_error is not None:
            on_error()
        # The other requests would run on into the next pass: cancel them (their connections close, SGLang aborts).
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
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


async def await_answer(fleet: EngineFleet, timeout_s: float = RECOVERY_S, poll_s: float = 1.0) -> float | None:
    """Seconds until the fleet's engine answers its health check (a generation), polled every `poll_s`; None
    if it does not within `timeout_s`."""
    start = time.perf_counter()
    deadline = start + timeout_s
    while (left := deadline - time.perf_counter()) > 0:
        # The record's current engine: the fleet may have replaced a dead one meanwhile.
        if await fleet.records[0].engine.health(timeout_s=min(fleet.cfg.health_timeout_s, left)):
            return time.perf_counter() - start
        await asyncio.sleep(min(poll_s, max(deadline - time.perf_counter(), 0.0)))  # the poll period
    return None


class EngineGone(Exception):
    """The engine did not answer its health check again after failing a pass: the variant is over."""


@dataclass
class SizeRun:
    """The passes of one variant at one size: it runs them, records runs and failures in `record` (the variant's
    report entry) and calls `save` after every round."""

    record: dict[str, Any]
    fleet: EngineFleet
    manager: RolloutManager
    args: argparse.Namespace
    requests: int
    save: Callable[[], None]

    # The engine's processes as a failing direct pass found them, its other requests still in flight.
    looked: list[dict[str, Any]] | None = field(default=None, init=False)
    # Whether the pass's health watcher is taking the engine's stacks (the pass waits for them at its end).
    dumping: bool = field(default=False, init=False)

    @property
    def failures(self) -> int:
        return sum(f.requests == self.requests for f in self.record["failures"])

    def look(self) -> None:
        self.looked = describe_processes(self.fleet)

    async def run(self) -> None:
        """Warm-up, then `--repeats` rounds, the size given up after MAX_FAILED_PASSES failed passes (EngineGone
        when the engine stops answering)."""
        args, n = self.args, self.requests
        prompts = make_prompts(n // args.group_size, args.prompt_len, args.vocab, seed=n)
        params = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, ignore_eos=True)
        passes = {"direct": lambda: direct_pass(self.fleet, prompts, args.group_size, params, self.look),
                  "manager": lambda: manager_pass(self.manager, prompts, args.group_size, params)}
        await self.attempt(passes["direct"], "direct", 0)  # warm-up
        complete, rnd = 0, 0
        while complete < args.repeats:
            if self.failures >= MAX_FAILED_PASSES:
                self.give_up(f"{self.failures} failed passes")
                return
            rnd += 1
            for mode in MODES:
                run = await self.attempt(passes[mode], mode, rnd)
                if run is None:  # the round is incomplete: on with the next one
                    break
                run.variant, run.round = self.record["variant"], rnd
                self.record["runs"].append(run)
                print(f"  {run.variant:14s} {run.mode:8s} {n:4d} requests: {run.tokens_per_s:10,.0f} tok/s "
                      f"({run.wall_s:.2f} s)", flush=True)
            else:
                complete += 1
            self.save()

    async def watch_health(self, mode: str, rnd: int, start: float) -> None:
        """During a pass: at the engine's first failed health check, its processes' stacks, recorded in the
        report's `stack_dumps` (and printed); then it returns. Runs until cancelled otherwise."""
        failed = self.fleet.failed_health_checks  # a running count: a check passing since does not hide one
        while self.fleet.failed_health_checks == failed:
            await asyncio.sleep(HEALTH_POLL_S)  # the poll period: the fleet has no hook for a failed check
        rec = self.fleet.records[0]
        entry: dict[str, Any] = {"requests": self.requests, "round": rnd, "mode": mode,
                                 "incarnation": rec.incarnation, "after_s": time.perf_counter() - start,
                                 "health_error": rec.last_error}
        print(f"  {self.record['variant']:14s} {mode:8s} {self.requests:4d} requests: health check failed in round "
              f"{rnd} after {entry['after_s']:.2f} s ({rec.last_error}); the engine's stacks:", flush=True)
        self.dumping = True
        entry["processes"] = await dump_stacks(engine_pids(self.fleet), find_py_spy())
        self.record.setdefault("stack_dumps", []).append(entry)
        for p in entry["processes"]:
            print(f"    --- pid {p['pid']} {p['command']}\n{p['stack']}\n    --- native\n{p.get('native_stack', '')}",
                  flush=True)
        self.save()

    async def attempt(self, one_pass: Callable[[], Any], mode: str, rnd: int) -> Run | None:
        """One pass: its Run, or None when the engine failed it (recorded) and answers again."""
        start = time.perf_counter()
        self.looked, self.dumping = None, False
        watcher = asyncio.create_task(self.watch_health(mode, rnd, start))
        try:
            run = await self.watched(one_pass, watcher)
        except ENGINE_FAILURES as exc:
            failure = Failure(self.record["variant"], self.requests, rnd, mode, f"{type(exc).__name__}: {exc}",
                              time.perf_counter() - start)
            self.record["failures"].append(failure)
            failure.processes = self.looked or describe_processes(self.fleet)
            rec = self.fleet.records[0]
            incarnation = rec.incarnation
            print(f"  {failure.variant:14s} {mode:8s} {self.requests:4d} requests: FAILED in round {rnd} after "
                  f"{failure.after_s:.2f} s: {failure.error}\n    engine {rec.engine_id}: {rec.state.value}, "
                  f"incarnation {incarnation}, health failures {rec.health_failures}", flush=True)
            print_processes(failure.processes)
            self.save()  # before the wait, which a benchmark cut short may not see the end of
            failure.recovered_s = await await_answer(self.fleet, RECOVERY_S)
            failure.replaced = self.fleet.records[0].incarnation != incarnation
            self.save()
            if failure.recovered_s is None:
                self.give_up(f"the engine did not answer its health check within {RECOVERY_S:.0f} s")
                raise EngineGone(failure.error) from exc
            print(f"    engine answered again after {failure.recovered_s:.1f} s"
                  f"{' (a replacement the fleet started)' if failure.replaced else ''}", flush=True)
            return None
        check(run, self.requests, self.args.new_tokens)
        return run

    async def watched(self, one_pass: Callable[[], Any], watcher: asyncio.Task[None]) -> Any:
        """`one_pass()`; then the health watcher is stopped, or awaited when it is taking the stacks."""
        try:
            return await one_pass()
        finally:
            if not self.dumping:
                watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher

    def give_up(self, reason: str) -> None:
        self.record["given_up"].append({"requests": self.requests, "reason": reason})
        print(f"  {self.record['variant']:14s} {self.requests:4d} requests: given up ({reason})", flush=True)
        self.save()


async def measure_variant(variant: str, args: argparse.Namespace, sizes: list[int], model_dir: str,
                          log_dir: str, done: list[dict[str, Any]] | None = None,
                          save: Callable[[], None] = lambda: None) -> dict[str, Any]:
    """Start `variant`'s engine, run the passes at every size, stop it; its runs, failures and start-up facts.
    Its entry joins `done` once the engine is up, and `save` is called after every round."""
    rollout = variant_rollout(variant, args.backend, max(sizes), args.group_size, args.new_tokens,
                              args.startup_timeout)
    ft = FaultToleranceConfig()
    started = time.perf_counter()
    fleet = await start_fleet(rollout, ft, model_dir, f"{log_dir}/{variant}", engines=1)
    startup_s = time.perf_counter() - started
    startup_heap.settle(collect=True)  # as `miles-lite train` once started: full collections skip the libraries
    manager = RolloutManager(fleet, rollout, ft)
    record: dict[str, Any] = {"variant": variant, "startup_s": startup_s,
                              "engine_capacity": [r.capacity for r in fleet.records],
                              "sglang_args": rollout.sglang_args, "runs": [], "failures": [], "given_up": []}
    if done is not None:
        done.append(record)
    try:
        print(f"{variant}: started in {startup_s:.1f} s, capacity {record['engine_capacity']}, "
              f"args {rollout.sglang_args}", flush=True)
        for i, n in enumerate(sizes):
            try:
                await SizeRun(record, fleet, manager, args, n, save).run()
            except EngineGone:
                record["given_up"] += [{"requests": later, "reason": "the engine stopped answering before"}
                                       for later in sizes[i + 1:]]
                break
    finally:
        await fleet.close()
    return record


def complete_rounds(runs: list[Run], requests: int) -> set[int]:
    """The rounds at `requests` whose passes (direct and manager) all completed."""
    modes: dict[int, set[str]] = {}
    for r in runs:
        if r.requests == requests:
            modes.setdefault(r.round, set()).add(r.mode)
    return {rnd for rnd, done in modes.items() if done >= set(MODES)}


def summarize(variants: list[dict[str, Any]], sizes: list[int]) -> list[dict[str, Any]]:
    """Median and min-max per variant, mode and size over the complete rounds, with their number and the failed
    passes; each manager median over the best raw median at its size."""
    rows = []
    for v in variants:
        for n in sizes:
            rounds = complete_rounds(v["runs"], n)
            row: dict[str, Any] = {"variant": v["variant"], "requests": n, "rounds": len(rounds),
                                   "failures": sum(f.requests == n for f in v.get("failures", []))}
            gave_up = [g["reason"] for g in v.get("given_up", []) if g["requests"] == n]
            if gave_up:
                row["given_up"] = gave_up[0]
            for mode in MODES:
                rates = sorted(r.tokens_per_s for r in v["runs"] if r.requests == n and r.mode == mode
                               and r.round in rounds)
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
            "variants": [{**{k: v for k, v in var.items() if k not in ("runs", "failures")},
                          "runs": [asdict(r) | {"tokens_per_s": r.tokens_per_s} for r in var["runs"]],
                          "failures": [asdict(f) for f in var.get("failures", [])]}
                         for var in variants]}


def write_report(path: str, report: dict[str, Any]) -> None:
    """Write `report` to `path` whole: a benchmark killed while writing leaves the previous report."""
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(report, indent=1))
    os.replace(tmp, path)


async def measure(args: argparse.Namespace, model_dir: str, log_dir: str) -> dict[str, Any]:
    """Every variant in turn; the JSON report (rewritten to `--out` after every round and variant)."""
    sizes = [int(s) for s in args.requests.split(",")]
    if any(n % args.group_size for n in sizes):
        raise ValueError(f"--requests {sizes} must all be multiples of --group-size {args.group_size}")
    done: list[dict[str, Any]] = []

    def save() -> None:
        if args.out:
            write_report(args.out, build_report(args, done, sizes))

    for variant in args.variants.split(","):
        await measure_variant(variant, args, sizes, model_dir, log_dir, done, save)
        save()
    return build_report(args, done, sizes)


def rounds_cell(row: dict[str, Any]) -> str:
    """The complete rounds of a summary row, with its failed passes and why its size was given up, if so."""
    cell = str(row.get("rounds", "-"))
    if row.get("failures"):
        cell += f" ({row['failures']} failed pass{'es' if row['failures'] > 1 else ''})"
    if row.get("given_up"):
        cell += f", given up: {row['given_up']}"
    return cell


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
          f"(min-max) of the complete rounds (of {args.repeats}); tokens/s")
    for var in report["variants"]:
        print(f"- {var['variant']}: start-up {var['startup_s']:.1f} s, capacity {var['engine_capacity']}")
    print("| variant | requests | rounds | raw SGLang (direct) | manager | manager / best raw |\n"
          "|---|---:|---:|---:|---:|---:|")
    for row in report["rows"]:
        d, m = row.get("direct_min_max", [0, 0]), row.get("manager_min_max", [0, 0])
        print(f"| {row['variant']} | {row['requests']} | {rounds_cell(row)} "
              f"| {row.get('direct_tok_s', 0):,.0f} ({d[0]:,.0f}-{d[1]:,.0f}) "
              f"| {row.get('manager_tok_s', 0):,.0f} ({m[0]:,.0f}-{m[1]:,.0f}) "
              f"| {row.get('manager_over_best_raw', float('nan')):.3f} |")
    if args.out:
        write_report(args.out, report)


if __name__ == "__main__":
    main()
