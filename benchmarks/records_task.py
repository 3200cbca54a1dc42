"""The records example (`experiment=letters_cpu`: reverse three letters, string labels, a TRL-style reward
plug-in) over several seeds: held-out exact accuracy before and after RL, and each run's wall time.

    python benchmarks/records_task.py                      # seeds 0-2
    python benchmarks/records_task.py --seeds 3 4 -- experiment.steps=200   # overrides for every run
    python benchmarks/records_task.py --table DIR/records_task.json          # the table of a saved run

Each seed runs as a user would (`PYTHONPATH=examples miles-lite train experiment=letters_cpu
experiment.seed=S`, one process at a time) and reads `eval/held_out/avg@1` (greedy exact match on the
128 held-out records) after the SFT warm-up and after RL from the run's `summary.json`. The gain's
standard error treats the two evaluations as independent samples of the held-out set
(sqrt(p1 (1 - p1) / n + p2 (1 - p2) / n)). Goal: a median gain of at least +15 points, each run within
5 minutes of wall time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MEASURE = "eval/held_out/avg@1"
HELD_OUT = 128
MIN_MEDIAN_GAIN, MAX_WALL_S = 15.0, 300.0


def run_seed(seed: int, out_dir: Path, overrides: list[str]) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "examples"),
                                                        os.environ.get("PYTHONPATH", "")])}
    name = f"seed{seed}"
    cmd = [sys.executable, "-m", "miles_lite.cli", "train", "experiment=letters_cpu", f"experiment.seed={seed}",
           f"experiment.output_dir={out_dir}", f"experiment.run_name={name}", "observability.progress=false",
           *overrides]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"seed {seed} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    summary = json.loads((out_dir / name / "summary.json").read_text())
    return {"seed": seed, "wall_s": wall, "before": summary["before"][MEASURE], "after": summary["after"][MEASURE]}


def table(runs: list[dict]) -> str:
    lines = [f"{'seed':>4}  {'before':>7}  {'after':>7}  {'gain':>7}  {'SE':>5}  {'wall s':>6}"]
    gains = []
    for r in runs:
        p1, p2 = r["before"], r["after"]
        se = 100 * math.sqrt(p1 * (1 - p1) / HELD_OUT + p2 * (1 - p2) / HELD_OUT)
        gain = 100 * (p2 - p1)
        gains.append(gain)
        lines.append(f"{r['seed']:>4}  {100 * p1:6.1f}%  {100 * p2:6.1f}%  {gain:+6.1f}  {se:5.1f}  {r['wall_s']:6.0f}")
    median = statistics.median(gains)
    slowest = max(r["wall_s"] for r in runs)
    ok = median >= MIN_MEDIAN_GAIN and slowest <= MAX_WALL_S
    lines.append(f"median gain {median:+.1f} points (goal >= +{MIN_MEDIAN_GAIN:g}), slowest run {slowest:.0f} s "
                 f"(goal <= {MAX_WALL_S:g}): {'met' if ok else 'NOT met'}")
    return "\n".join(lines)


def seeded_main(name: str, doc: str | None, run_seed: Callable[[int, Path, list[str]], dict],
                table: Callable[[list[dict]], str], progress: Callable[[dict], str]) -> int:
    """The command line of a seeded task benchmark: one run per seed, `<name>.json` rewritten after each."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", default=None, help="directory for the runs (default: a temporary one)")
    parser.add_argument("--table", default=None, help=f"print the table of a saved {name}.json")
    parser.add_argument("overrides", nargs="*", help="overrides for every run (after --)")
    args = parser.parse_args()
    if args.table:
        print(table(json.loads(Path(args.table).read_text())["runs"]))
        return 0
    out = Path(args.out or tempfile.mkdtemp(prefix=f"{name}_"))
    out.mkdir(parents=True, exist_ok=True)
    runs = []
    for seed in args.seeds:
        runs.append(run_seed(seed, out, args.overrides))
        (out / f"{name}.json").write_text(json.dumps({"overrides": args.overrides, "runs": runs}, indent=1))
        print(f"seed {seed}: {progress(runs[-1])}", flush=True)
    print(table(runs))
    print(f"saved: {out / f'{name}.json'}")
    return 0


def main() -> int:
    return seeded_main("records_task", __doc__, run_seed, table,
                       lambda r: f"{100 * r['before']:.1f}% -> {100 * r['after']:.1f}% in {r['wall_s']:.0f} s")


if __name__ == "__main__":
    sys.exit(main())
