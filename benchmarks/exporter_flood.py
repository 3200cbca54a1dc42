"""Step time of a CPU training-like loop while its metrics exporter is flooded, for the project's exporter and for
prometheus_client's threaded server (one thread per connection), interleaved.

    python benchmarks/exporter_flood.py --rounds 3 --steps 20 --clients 32 --idle 200

Each round, for each server: start it in this process on a registry with the project's metrics, then time
`--steps` steps (a fixed torch matmul workload plus a metrics publish) three ways: quiet, while a separate
process scrapes with `--clients` concurrent clients as fast as answers come, and the same flood with `--idle`
extra connections held open without a request. Prints the mean step time per case and the threads the
process held during the flood.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import statistics
import threading
import time
import urllib.request

import torch
from prometheus_client import start_http_server

from miles_lite.observability.exporter import MetricsExporter
from miles_lite.observability.metrics import MetricsRegistry


def _flood(port: int, clients: int, idle: int, stop: mp.Event) -> None:
    held = []
    for _ in range(idle):
        try:
            held.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        except OSError:
            break

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
    stop.wait()
    for s in held:
        s.close()


def _steps(reg: MetricsRegistry, n: int) -> list[float]:
    a = torch.randn(256, 256)
    times = []
    for step in range(n):
        start = time.perf_counter()
        for _ in range(40):
            a = torch.tanh(a @ a) * 0.5
        reg.publish_step(step, {"reward/mean": float(a.mean()), "rollout/generated_tokens": 100})
        times.append(time.perf_counter() - start)
    return times


def _serve(kind: str, reg: MetricsRegistry):
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
    print(f"load average before: {os.getloadavg()[0]:.1f}")
    for _ in range(args.rounds):
        for kind in ("threaded", "project"):
            reg = MetricsRegistry("bench", "driver")
            port, stop_server = _serve(kind, reg)
            try:
                results.setdefault((kind, "quiet"), []).extend(_steps(reg, args.steps))
                for case, idle in (("flood", 0), ("flood+idle", args.idle)):
                    stop = mp.Event()
                    proc = mp.Process(target=_flood, args=(port, args.clients, idle, stop), daemon=True)
                    proc.start()
                    time.sleep(1.0)  # let the flood reach its pace before timing
                    results.setdefault((kind, case), []).extend(_steps(reg, args.steps))
                    threads_seen[kind] = max(threads_seen.get(kind, 0), threading.active_count())
                    stop.set()
                    proc.join(30)
            finally:
                stop_server()
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    for kind in ("threaded", "project"):
        cells = [f"{case} {statistics.mean(results[(kind, case)]) * 1e3:.0f} ms"
                 for case in ("quiet", "flood", "flood+idle")]
        print(f"{kind:9s} step: {', '.join(cells)}; threads during the flood: {threads_seen[kind]}")


if __name__ == "__main__":
    main()
