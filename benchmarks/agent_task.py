"""The agent example (`experiment=agent_cpu`: an `openai`-client agent following lookup chains through the
session gateway) over several seeds: held-out success before and after RL, the SFT steps, each run's wall
time and the machine's load while it ran.

    python benchmarks/agent_task.py                                  # seeds 0-2
    python benchmarks/agent_task.py --seeds 3 -- experiment.steps=150    # overrides for every run
    python benchmarks/agent_task.py --table DIR/agent_task.json          # the table of a saved run

Each seed runs as a user would (`PYTHONPATH=examples miles-lite train experiment=agent_cpu experiment.seed=S`,
one process at a time) and reads `eval/held_out/avg@1` (greedy: the share of the 500 held-out records whose
agent answered right) after the SFT warm-up and after RL from the run's `summary.json`. The gain's standard
error treats the two evaluations as independent samples of the held-out set
(sqrt(p1 (1 - p1) / n + p2 (1 - p2) / n)). The load average (1 min) is sampled every 5 s while a run goes (the
machine may be shared), and the CPU seconds the run's processes used (user + system, every engine and worker
included) are read when it ends: on a machine of its own, two cores run a run in about half of those. Goal: a
gain of at least +10 points on every seed, each run within 5 minutes.
"""

from __future__ import annotations

import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from records_task import seeded_main  # the benchmarks directory is the script's first path entry

ROOT = Path(__file__).resolve().parents[1]
MEASURE = "eval/held_out/avg@1"
HELD_OUT = 500
MIN_GAIN, MAX_WALL_S = 10.0, 300.0


def run_seed(seed: int, out_dir: Path, overrides: list[str]) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "examples"),
                                                        os.environ.get("PYTHONPATH", "")])}
    name = f"seed{seed}"
    cmd = [sys.executable, "-m", "miles_lite.cli", "train", "experiment=agent_cpu", f"experiment.seed={seed}",
           f"experiment.output_dir={out_dir}", f"experiment.run_name={name}", "observability.progress=false",
           *overrides]
    loads = []
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    while proc.poll() is None:
        loads.append(os.getloadavg()[0])
        try:
            proc.wait(timeout=5)  # the sampling period of the load average
        except subprocess.TimeoutExpired:
            pass
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)  # the run and every process it waited for
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    output = proc.stdout.read() if proc.stdout else ""
    if proc.returncode != 0:
        raise SystemExit(f"seed {seed} failed (exit {proc.returncode}):\n{output[-4000:]}")
    run = out_dir / name
    summary = json.loads((run / "summary.json").read_text())
    warmup = [json.loads(line) for line in (run / "warmup.jsonl").read_text().splitlines()]
    return {"seed": seed, "wall_s": wall, "before": summary["before"][MEASURE], "after": summary["after"][MEASURE],
            "sft_steps": len(warmup), "steps": summary["steps_done"], "cpu_s": cpu,
            "load_mean": statistics.mean(loads) if loads else 0.0, "load_max": max(loads, default=0.0)}


def table(runs: list[dict]) -> str:
    lines = [f"{'seed':>4}  {'SFT':>4}  {'before':>7}  {'after':>7}  {'gain':>7}  {'SE':>5}  {'wall s':>6}  "
             f"{'CPU s':>6}  {'load mean/max':>13}"]
    gains = []
    for r in runs:
        p1, p2 = r["before"], r["after"]
        se = 100 * math.sqrt(p1 * (1 - p1) / HELD_OUT + p2 * (1 - p2) / HELD_OUT)
        gain = 100 * (p2 - p1)
        gains.append(gain)
        lines.append(f"{r['seed']:>4}  {r['sft_steps']:>4}  {100 * p1:6.1f}%  {100 * p2:6.1f}%  {gain:+6.1f}  "
                     f"{se:5.1f}  {r['wall_s']:6.0f}  {r.get('cpu_s', 0.0):6.0f}  "
                     f"{r['load_mean']:6.1f}/{r['load_max']:<5.1f}")
    slowest = max(r["wall_s"] for r in runs)
    ok = min(gains) >= MIN_GAIN and slowest <= MAX_WALL_S
    lines.append(f"gains {min(gains):+.1f} to {max(gains):+.1f} points (median {statistics.median(gains):+.1f}; goal "
                 f">= +{MIN_GAIN:g} each), slowest run {slowest:.0f} s (goal <= {MAX_WALL_S:g}): "
                 f"{'met' if ok else 'NOT met'}")
    return "\n".join(lines)


def main() -> int:
    return seeded_main("agent_task", __doc__, run_seed, table,
                       lambda r: f"{100 * r['before']:.1f}% -> {100 * r['after']:.1f}% in {r['wall_s']:.0f} s "
                                 f"(load {r['load_mean']:.1f})")


if __name__ == "__main__":
    sys.exit(main())
