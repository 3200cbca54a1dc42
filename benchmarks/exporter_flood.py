"""Step time of a CPU training-like loop while its metrics exporter is flooded, for the project's exporter and for
prometheus_client's threaded server (one thread per connection), interleaved.

    python benchmarks/exporter_flood.py --rounds 3 --steps 20 --clients 32 --idle 200

Each round, for each server: start it on a registry with the project's metrics, then time `--steps` steps (a
fixed torch matmul workload plus a metrics publish) three ways: quiet, while a separate process scrapes with
`--clients` concurrent clients as fast as answers come, and the same flood with `--idle` extra connections
held open without a request. `threaded` and `project` serve from the timed process, as a trainer's exporter
does; `elsewhere` is the project's exporter in another process, the floor: what the flood costs the step on
this machine (the scraping process's own CPU) when no thread of the timed process serves it. Prints the median
step time per case (min-max over every round's steps), the most threads the timed process had started for the
server during the floods, and how many idle connections the server had accepted when timing began.
"""

from __future__ import annotations

import argparse
import functools
import multiprocessing as mp
import os
import socket
import statistics
import threading
import time
import urllib.request
from collections.abc import Callable

import torch
from prometheus_client import start_http_server

from miles_lite.observability.exporter import MetricsExporter
from miles_lite.observability.metrics import MetricsRegistry


def _flood(port: int, clients: int, idle: int, stop: mp.Event, opened) -> None:
    def client() -> None:
        while not stop.is_set():
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
                    resp.read()
            except OSError:
                time.sleep(0.01)  # refused or reset under load: try again

    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    # Idle connections after the clients started: a server with a short listen backlog (the threaded one's is 5)
    # accepts them slowly, and the flood must not wait for that.
    held = []
    for _ in range(idle):
        if stop.is_set():
            break
        try:
            held.append(socket.create_connection(("127.0.0.1", port), timeout=5))
            opened.value = len(held)
        except OSError:
            continue
    stop.wait()
    for s in held:
        s.close()


def _steps(reg: MetricsRegistry, n: int, between: Callable[[], None] = lambda: None) -> list[float]:
    """Step times; `between` runs after each step, outside the timing."""
    a = torch.randn(256, 256)
    times = []
    for step in range(n):
        start = time.perf_counter()
        for _ in range(40):
            a = torch.tanh(a @ a) * 0.5
        reg.publish_step(step, {"reward/mean": float(a.mean()), "rollout/generated_tokens": 100})
        times.append(time.perf_counter() - start)
        between()
    return times


def _note_threads(seen: dict[str, int], kind: str, before: set[int | None]) -> None:
    """The most threads started since `before` seen so far for `kind`."""
    started = sum(t.ident not in before for t in threading.enumerate())
    seen[kind] = max(seen.get(kind, 0), started)


def _serve_in_child(ready: mp.Queue, stop: mp.Event) -> None:
    port, stop_server = _serve("project", MetricsRegistry("bench", "driver"))
    ready.put(port)
    stop.wait()
    stop_server()


def _serve(kind: str, reg: MetricsRegistry):
    if kind == "elsewhere":
        ready, stop = mp.Queue(), mp.Event()
        proc = mp.Process(target=_serve_in_child, args=(ready, stop), daemon=True)
        proc.start()

        def stop_child() -> None:
            stop.set()
            proc.join(10)

        return ready.get(timeout=30), stop_child
    if kind == "project":
        exp = MetricsExporter(reg, "127.0.0.1", 0)
        exp.start()
        return exp.port, exp.stop
    server, thread = start_http_server(0, addr="127.0.0.1", registry=reg.registry)

    def stop() -> None:
        server.shutdown()
        server.server_close()
        thread.join(5)

    return server.server_address[1], stop


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--idle", type=int, default=200)
    args = p.parse_args()
    torch.set_num_threads(1)
    results: dict[tuple[str, str], list[float]] = {}
    threads_seen: dict[str, int] = {}
    idle_held: dict[str, list[int]] = {}
    print(f"load average before: {os.getloadavg()[0]:.1f}")
    kinds = ("threaded", "project", "elsewhere")
    for _ in range(args.rounds):
        for kind in kinds:
            reg = MetricsRegistry("bench", "driver")
            # Threads the server starts from here on (a previous server's lingering handlers are not its own).
            before = {t.ident for t in threading.enumerate()}
            port, stop_server = _serve(kind, reg)
            try:
                results.setdefault((kind, "quiet"), []).extend(_steps(reg, args.steps))
                for case, idle in (("flood", 0), ("flood+idle", args.idle)):
                    stop, opened = mp.Event(), mp.Value("i", 0)
                    proc = mp.Process(target=_flood, args=(port, args.clients, idle, stop, opened), daemon=True)
                    proc.start()
                    time.sleep(1.0)  # let the flood reach its pace before timing
                    deadline = time.monotonic() + 60  # and the idle connections be held (a short backlog is slow)
                    while opened.value < idle and time.monotonic() < deadline:
                        time.sleep(0.1)
                    if idle:
                        idle_held.setdefault(kind, []).append(opened.value)
                    count = functools.partial(_note_threads, threads_seen, kind, before)
                    results.setdefault((kind, case), []).extend(_steps(reg, args.steps, count))
                    stop.set()
                    proc.join(30)
            finally:
                stop_server()
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    for kind in kinds:
        cells = []
        for case in ("quiet", "flood", "flood+idle"):
            ms = [t * 1e3 for t in results[(kind, case)]]
            cells.append(f"{case} {statistics.median(ms):.0f} ms ({min(ms):.0f}-{max(ms):.0f})")
        print(f"{kind:9s} step: {', '.join(cells)}; server threads in this process: {threads_seen[kind]}; "
              f"idle connections held: {min(idle_held[kind])}")


if __name__ == "__main__":
    main()
