"""The embedded default (`miles-lite train`, `experiment=tiny_cpu`) over several seeds, against more SFT.

    python benchmarks/embedded_default.py                       # seeds 0-4, then each seed's SFT control
    python benchmarks/embedded_default.py --seeds 1 --no-control
    python benchmarks/embedded_default.py --control-seeds 0 1  # RL on seeds 0-4, the control on 0 and 1
    python benchmarks/embedded_default.py --seeds 0 1 -- rollout.temperature=0.7   # overrides for every run
    python benchmarks/embedded_default.py --table DIR/embedded_default.json     # the table of a saved run

For each seed it runs the default exactly as a user would (`miles-lite train experiment.seed=S`, one
process at a time) and reads held-out exact accuracy after the SFT warm-up and after RL from the run's
`summary.json`. The control answers "would the same time spent on more SFT do as well?": the same seed
with the RL steps replaced by as many extra SFT steps as fit in the time the RL loop took
(`experiment.steps=0 experiment.warmup_steps=W+X`, X = RL-loop seconds / seconds per SFT step, both
measured on the seed's RL run). The control's SFT draws from the same demonstrations as the warm-up
(`experiment.warmup_demos`), while RL draws answer-only questions from the whole training set. Its first
W SFT steps are the RL run's warm-up (the same batches from the same seed), which the table checks by
comparing the SFT loss at step W of both runs. Every RL run comes first, then the controls, and the
results are saved after each run, so an interrupted benchmark keeps what it measured.

Times come from the run's own output lines, stamped as they arrive: the SFT rate from the first and last
"sft warm-up" lines, the RL loop from the end of the first evaluation to the final checkpoint line.
The gain's standard error treats the two evaluations as independent samples of the held-out set
(sqrt(p1 (1 - p1) / n + p2 (1 - p2) / n)); they are the same problems, so this overstates it. RL's lead
over the control gets the same treatment, and the goal asks for at least 2 of those on every seed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

SFT_LINE = re.compile(r"^sft warm-up (\d+)/(\d+): loss")
# Goal of the default: every seed gains this many points, the median this many, each run within this wall.
MIN_GAIN, MIN_MEDIAN_GAIN, MAX_WALL_S = 10.0, 20.0, 180.0
# ... and RL ends this many standard errors (of the difference) above more SFT in the same time, on every seed.
MIN_LEAD_SE = 2.0


@dataclass
class Run:
    """One `miles-lite train` process: its summary, SFT losses and the time stamps of its phases."""

    run_dir: str
    wall_s: float
    before: dict[str, float]
    after: dict[str, float]
    sft_steps: int
    sft_s_per_step: float
    rl_loop_s: float
    sft_losses: list[float] = field(default_factory=list)


def run_train(out_dir: Path, name: str, overrides: list[str], log: Path) -> Run:
    """Run `miles-lite train` with `overrides`, stamping each output line as it arrives."""
    cmd = [sys.executable, "-m", "miles_lite.cli", "train", f"experiment.output_dir={out_dir}",
           f"experiment.run_name={name}", "observability.progress=false", *overrides]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    start = time.perf_counter()
    stamps: dict[str, float] = {}
    sft_first = sft_last = None
    with log.open("w") as sink, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                                 text=True, env=env) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            now = time.perf_counter() - start
            sink.write(f"{now:8.2f} {line}")
            sink.flush()
            m = SFT_LINE.match(line)
            if m:
                step = int(m.group(1))
                sft_first = sft_first or (step, now)
                sft_last = (step, now)
            elif line.startswith("after warm-up (") and "eval_done" not in stamps:
                stamps["eval_done"] = now
            elif line.startswith("checkpoint step "):
                stamps["final_checkpoint"] = now
        code = proc.wait()
    wall = time.perf_counter() - start
    if code != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {code}; log: {log}")
    run_dir = out_dir / name
    summary = json.loads((run_dir / "summary.json").read_text())
    warmup = run_dir / "warmup.jsonl"  # absent when the run skips the warm-up (experiment.warmup=none)
    losses = [json.loads(line)["loss"] for line in warmup.read_text().splitlines()] if warmup.is_file() else []
    per_step = float("nan")
    if sft_first and sft_last and sft_last[0] > sft_first[0]:
        per_step = (sft_last[1] - sft_first[1]) / (sft_last[0] - sft_first[0])
    rl_loop = stamps.get("final_checkpoint", math.nan) - stamps.get("eval_done", math.nan)
    return Run(str(run_dir), wall, summary["before"], summary["after"], len(losses), per_step, rl_loop, losses)


def gain_se(p1: float, p2: float, n: int) -> float:
    return math.sqrt((p1 * (1 - p1) + p2 * (1 - p2)) / max(n, 1))


def pct(x: float) -> str:
    return f"{x * 100:.1f}%"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--control-seeds", type=int, nargs="*", default=None,
                        help="seeds that also get the more-SFT control (default: every seed)")
    parser.add_argument("--no-control", action="store_true", help="skip the more-SFT control runs")
    parser.add_argument("--out", type=Path, default=None, help="run directories and logs (default: a temp dir)")
    parser.add_argument("--table", type=Path, default=None, help="print the table of a saved embedded_default.json")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides passed to every run (after --)")
    args = parser.parse_args()
    if args.table:
        print(table(json.loads(args.table.read_text())))
        return 0
    out = args.out or Path(tempfile.mkdtemp(prefix="embedded_default_"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"runs under {out}", flush=True)
    control_seeds = [] if args.no_control else (args.seeds if args.control_seeds is None else args.control_seeds)

    # Every RL run first, then the controls: an interrupted benchmark still has the whole RL column.
    rows: dict[int, dict] = {}
    for seed in args.seeds:
        load = os.getloadavg()[0]
        rl = run_train(out, f"rl-seed{seed}", [f"experiment.seed={seed}", *args.overrides], out / f"rl-seed{seed}.log")
        rows[seed] = {"seed": seed, "rl": asdict(rl), "load": [load, os.getloadavg()[0]]}
        n = int(rl.before["n"])
        b, a = rl.before["exact"], rl.after["exact"]
        print(f"seed {seed}: {pct(b)} after warm-up -> {pct(a)} after RL ({(a - b) * 100:+.1f} points, "
              f"SE {gain_se(b, a, n) * 100:.1f}, {n} problems), RL loop {rl.rl_loop_s:.0f} s, "
              f"wall {rl.wall_s:.0f} s", flush=True)
        save(out, rows)
    for seed in control_seeds:
        row = rows[seed]
        rl = Run(**row["rl"])
        extra = max(1, round(rl.rl_loop_s / rl.sft_s_per_step))
        # A warm-up that ends at a loss (experiment.warmup_stop_loss) would end the control at the same step.
        ctl = run_train(out, f"sft-seed{seed}", [f"experiment.seed={seed}", *args.overrides, "experiment.steps=0",
                                                 f"experiment.warmup_steps={rl.sft_steps + extra}",
                                                 "experiment.warmup_stop_loss=null"],
                        out / f"sft-seed{seed}.log")
        row["control"] = asdict(ctl)
        row["control_extra_steps"] = extra
        # The control repeats the RL run's warm-up: same batches, so the same loss at its last step.
        row["same_warmup"] = ctl.sft_losses[rl.sft_steps - 1] == rl.sft_losses[-1]
        c, b = ctl.before["exact"], rl.before["exact"]
        print(f"seed {seed} control: {extra} more SFT steps -> {pct(c)} ({(c - b) * 100:+.1f} points), "
              f"same warm-up as the RL run: {row['same_warmup']}, wall {ctl.wall_s:.0f} s", flush=True)
        save(out, rows)
    print(table(list(rows.values())))
    return 0


def save(out: Path, rows: dict[int, dict]) -> None:
    (out / "embedded_default.json").write_text(json.dumps(list(rows.values()), indent=2))


def table(rows: list[dict]) -> str:
    head = ("| seed | problems | after SFT warm-up | after RL | RL gain (SE) | wall | "
            "more SFT instead (steps) | after more SFT | SFT gain | RL − more SFT (SE) |")
    lines = [head, "|---:" * (head.count("|") - 1) + "|"]
    gains, control_gains, walls, ratios, leads = [], [], [], [], []
    for r in rows:
        rl = r["rl"]
        n, b, a = int(rl["before"]["n"]), rl["before"]["exact"], rl["after"]["exact"]
        se = gain_se(b, a, n)
        gains.append((a - b) * 100)
        walls.append(rl["wall_s"])
        ratios.append((a - b) / se if se else math.nan)
        if "control" in r:
            c = r["control"]["before"]["exact"]
            control_gains.append((c - b) * 100)
            lead_se = gain_se(c, a, n)
            leads.append((a - c) / lead_se if lead_se else math.nan)
            ctl = (f" +{r['control_extra_steps']} | {pct(c)} | {(c - b) * 100:+.1f} | "
                   f"{(a - c) * 100:+.1f} ({lead_se * 100:.1f}) |")
        else:
            ctl = " - | - | - | - |"
        lines.append(f"| {r['seed']} | {n} | {pct(b)} | {pct(a)} | {(a - b) * 100:+.1f} ({se * 100:.1f}) | "
                     f"{rl['wall_s']:.0f} s |{ctl}")
    lines.append("")
    lines.append(f"RL gain: min {min(gains):+.1f}, median {statistics.median(gains):+.1f} points; "
                 f"smallest gain / its standard error: {min(ratios):.1f}; wall max {max(walls):.0f} s")
    if control_gains:
        lines.append(f"more SFT in the same time: min {min(control_gains):+.1f}, "
                     f"median {statistics.median(control_gains):+.1f} points; RL's smallest lead over it: "
                     f"{min(leads):.1f} standard errors")
    met = (min(gains) >= MIN_GAIN and statistics.median(gains) >= MIN_MEDIAN_GAIN and max(walls) <= MAX_WALL_S
           and all(lead >= MIN_LEAD_SE for lead in leads))
    loads = [x for r in rows for x in r.get("load", [])]
    if loads:
        lines.append(f"1-minute load average at the start and end of the RL runs: {min(loads):.1f} to {max(loads):.1f}")
    lines.append(f"goal (every seed >= +{MIN_GAIN:.0f}, median >= +{MIN_MEDIAN_GAIN:.0f}, wall <= {MAX_WALL_S:.0f} s"
                 f"{f', RL ahead of more SFT by >= {MIN_LEAD_SE:.0f} SE on every seed' if leads else ''}): "
                 f"{'met' if met else 'NOT met'}")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
