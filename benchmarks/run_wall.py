"""Wall time of `miles-lite train` from two source trees, interleaved: start-up, the tail after the last
output line (interpreter and engine shutdown), and the whole run, with the results compared.

    python benchmarks/run_wall.py --before /path/to/old/checkout --after . --pairs 5 \
        -- experiment.warmup_steps=30 experiment.steps=5

Each round runs the old tree, then the new one (`python -m miles_lite.cli train OVERRIDES` with the
tree first on PYTHONPATH, one process at a time), stamping every output line as it arrives:

- start-up: process start to the "Prometheus metrics at" line (imports, the initial model, the trainer,
  the engines, the weight-sync group);
- tail: the "run directory:" line (the run's last) to the process's exit;
- wall: process start to exit.

It also checks that both trees computed the same run: the held-out shares before and after RL in each
run's `summary.json` must be equal. The warm-up is deterministic for a seed; RL is over a few steps, but
over many the timing of which requests share an engine's batch can shift its float rounding, so compare
short runs. The 1-minute load average is printed before and after the benchmark.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def run_once(tree: Path, overrides: list[str], out_dir: Path) -> dict:
    """One `miles-lite train` run from `tree`: its phase times and its summary."""
    env = {**os.environ, "PYTHONPATH": str(tree.resolve())}
    cmd = [sys.executable, "-m", "miles_lite.cli", "train", *overrides, f"experiment.output_dir={out_dir}"]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    marks: dict[str, float] = {}
    assert proc.stdout is not None
    for line in proc.stdout:
        now = time.monotonic() - start
        if "Prometheus metrics at" in line:
            marks["startup"] = now
        if "run directory:" in line:
            marks["last_line"] = now
    code = proc.wait()
    wall = time.monotonic() - start
    if code != 0 or "startup" not in marks or "last_line" not in marks:
        raise RuntimeError(f"{' '.join(cmd)} exited {code} (marks {marks}); see {out_dir}")
    summary = json.loads(next(out_dir.glob("*/summary.json")).read_text())
    return {"startup": marks["startup"], "tail": wall - marks["last_line"], "wall": wall,
            "before": summary["before"], "after": summary["after"]}


def spread(values: list[float]) -> str:
    return f"{min(values):6.1f} {statistics.median(values):6.1f} {max(values):6.1f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, required=True, help="source tree of the old code")
    parser.add_argument("--after", type=Path, default=Path("."), help="source tree of the new code")
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides of every run (after --)")
    args = parser.parse_args()
    print(f"load average before: {os.getloadavg()[0]:.1f}", flush=True)
    results: dict[str, list[dict]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory(prefix="run_wall-") as tmp:
        for i in range(args.pairs):
            for name, tree in (("before", args.before), ("after", args.after)):
                r = run_once(tree, args.overrides, Path(tmp) / f"{name}-{i}")
                results[name].append(r)
                print(f"pair {i} {name:6s}: start-up {r['startup']:5.1f} s, tail {r['tail']:4.1f} s, "
                      f"wall {r['wall']:5.1f} s, exact {r['before'].get('exact')} -> {r['after'].get('exact')}",
                      flush=True)
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    print("             min  median    max   (seconds)")
    for key in ("startup", "tail", "wall"):
        for name in ("before", "after"):
            print(f"{key:8s} {name:6s} {spread([r[key] for r in results[name]])}")
    same = all(b["before"] == a["before"] and b["after"] == a["after"]
               for b, a in zip(results["before"], results["after"], strict=True))
    print(f"same summary (held-out shares before and after RL) in every pair: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
