"""The embedded default (`experiment=tiny_cpu`) with LoRA adapters against full fine-tuning, on CPU.

    python benchmarks/lora_cpu.py                          # seeds 0-2, rank 16, RL from the SFT'd model
    python benchmarks/lora_cpu.py --base random            # LoRA from the random model, SFT warm-up included
    python benchmarks/lora_cpu.py --seeds 0 --rank 8 --lr-scale 5
    python benchmarks/lora_cpu.py --table DIR/lora_cpu.json   # the table of a saved run

`--base sft` (default; LoRA RL as it is used, on a trained base): per seed, the default's SFT warm-up runs
once with full weights (`experiment.steps=0`), its checkpoint becomes an HF directory (`miles-lite convert
--to-hf`), and both arms start RL from it (`model.hf_path=... experiment.warmup=none`): full fine-tuning, and
`trainer.lora.rank=R trainer.lora.alpha=2R`. `--base random`: both arms are the whole default, so LoRA also
does the SFT warm-up of the random model. LoRA's learning rates (`trainer.lr`, and `experiment.warmup_lr`
for its warm-up) are the full fine-tune's times `--lr-scale` (default 10: LoRA's best learning rate sits
about ten times above full fine-tuning's, largely independent of rank, in the "LoRA without regret"
sweeps; alpha = 2r keeps the adapters' scale fixed across ranks). Held-out exact
accuracy after the warm-up and after RL comes from each run's `summary.json`; push bytes and seconds are the
mean `sync/bytes` and `sync/seconds` of the RL steps' pushes (`metrics.jsonl`). "The same wall time": when the
LoRA run's RL loop took a different time than the full fine-tune's (by more than `--wall-tolerance`), LoRA
runs again with as many RL steps as fit in the full fine-tune's RL-loop time at its own rate, and that run's
gain is the one compared. Runs go one at a time; results are saved after each.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from embedded_default import gain_se, pct, run_train  # noqa: E402

# The embedded default's learning rates (conf/trainer/cpu.yaml, conf/experiment/tiny_cpu.yaml).
FULL_LR, FULL_WARMUP_LR = 5e-4, 3e-3


def push_stats(run_dir: str) -> dict[str, float]:
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    pushes = [r for r in rows if "sync/bytes" in r]
    return {"bytes": statistics.mean(r["sync/bytes"] for r in pushes),
            "seconds": statistics.mean(r["sync/seconds"] for r in pushes),
            "probe_diff_max": max(r.get("sync/probe_logp_diff_mean", 0.0) for r in pushes)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--lr-scale", type=float, default=10.0)
    parser.add_argument("--base", choices=("sft", "random"), default="sft")
    parser.add_argument("--wall-tolerance", type=float, default=0.1,
                        help="relative RL-loop time difference above which LoRA runs again at equal time")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--table", type=Path, default=None)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides passed to every run (after --)")
    args = parser.parse_args()
    if args.table:
        print(table(json.loads(args.table.read_text())))
        return 0
    out = args.out or Path(tempfile.mkdtemp(prefix="lora_cpu_"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"runs under {out}", flush=True)
    lora = [f"trainer.lora.rank={args.rank}", f"trainer.lora.alpha={2 * args.rank}",
            f"trainer.lr={FULL_LR * args.lr_scale:g}", f"experiment.warmup_lr={FULL_WARMUP_LR * args.lr_scale:g}"]
    rows = []
    for seed in args.seeds:
        base = [f"experiment.seed={seed}", *args.overrides]
        if args.base == "sft":
            base += [f"model.hf_path={sft_model(out, seed, args.overrides)}", "experiment.warmup=none"]
        full = run_train(out, f"full-seed{seed}", base, out / f"full-seed{seed}.log")
        lo = run_train(out, f"lora-seed{seed}", [*base, *lora], out / f"lora-seed{seed}.log")
        row = {"seed": seed, "full": asdict(full), "lora": asdict(lo), "full_push": push_stats(full.run_dir),
               "lora_push": push_stats(lo.run_dir), "lora_args": lora}
        if abs(lo.rl_loop_s - full.rl_loop_s) > args.wall_tolerance * full.rl_loop_s:
            done = json.loads((Path(lo.run_dir) / "summary.json").read_text())["steps_done"]
            steps = max(1, round(done * full.rl_loop_s / lo.rl_loop_s))
            same = run_train(out, f"lora-wall-seed{seed}", [*base, *lora, f"experiment.steps={steps}"],
                             out / f"lora-wall-seed{seed}.log")
            row["lora_same_wall"] = asdict(same)
            row["lora_same_wall_steps"] = steps
        rows.append(row)
        (out / "lora_cpu.json").write_text(json.dumps(rows, indent=2))
        print(table(rows), flush=True)
    return 0


def sft_model(out: Path, seed: int, overrides: list[str]) -> Path:
    """The default's SFT warm-up alone (full weights), as an HF directory."""
    hf = out / f"sft-seed{seed}-hf"
    if not (hf / "config.json").is_file():
        sft = run_train(out, f"sft-seed{seed}", [f"experiment.seed={seed}", *overrides, "experiment.steps=0"],
                        out / f"sft-seed{seed}.log")
        subprocess.run([sys.executable, "-m", "miles_lite.cli", "convert", "--to-hf",
                        str(Path(sft.run_dir) / "checkpoints"), str(hf)], check=True, capture_output=True)
    return hf


def _gain(run: dict) -> tuple[float, float]:
    n, b, a = int(run["before"]["n"]), run["before"]["exact"], run["after"]["exact"]
    return (a - b) * 100, gain_se(b, a, n) * 100


def table(rows: list[dict]) -> str:
    head = ("| seed | full FT: after SFT -> after RL (gain, SE) | LoRA: after SFT -> after RL (gain, SE) | "
            "LoRA at full FT's RL time (steps, gain) | push bytes full / LoRA | push s full / LoRA | "
            "RL loop s full / LoRA |")
    lines = [head, "|---:" * (head.count("|") - 1) + "|"]
    for r in rows:
        cells = []
        for key in ("full", "lora"):
            run = r[key]
            g, se = _gain(run)
            cells.append(f"{pct(run['before']['exact'])} -> {pct(run['after']['exact'])} ({g:+.1f}, {se:.1f})")
        same = r.get("lora_same_wall")
        cells.append(f"{r['lora_same_wall_steps']}, {_gain(same)[0]:+.1f}" if same else "same run")
        fp, lp = r["full_push"], r["lora_push"]
        cells.append(f"{fp['bytes'] / 1e6:.2f} MB / {lp['bytes'] / 1e6:.3f} MB")
        cells.append(f"{fp['seconds']:.3f} / {lp['seconds']:.3f}")
        cells.append(f"{r['full']['rl_loop_s']:.0f} / {r['lora']['rl_loop_s']:.0f}")
        lines.append(f"| {r['seed']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
