"""The summary of a GPU sitting (`scripts/gpu_checks.sh OUT sitting`): OUT/summary.md, one table a goal.

    python scripts/gpu_summary.py OUT

Reads what the parts left in OUT (parts.tsv: each part's status, seconds and start; the benchmarks' JSON files;
gpu-clocks.csv: the card's clocks) and
writes the figures the GRPO-speed goals are judged by, with their spread, rewritten after every part so that a
sitting cut short still summarises what it measured. Prints the summary too.
"""

from __future__ import annotations

import json
import sys
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

TRANSITIONS = ("offload", "engine_sleep", "onload", "engine_wake")


# The GRPO parts of scripts/gpu_checks.sh (benchmarks/grpo_steps.py results).
GRPO_RUNS = ("colocated-0.5b", "colocated-0.5b-kept", "colocated-7b", "colocated-7b-kept", "lora-7b", "lora-7b-merged",
             "lora-7b-tensors", "resident-0.5b")


def _load(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _mmm(spread: dict[str, Any], key: str) -> str:
    v = spread.get(key)
    return "-" if not v else f"{v['median']:.2f} ({v['min']:.2f}-{v['max']:.2f})"


def parts_table(out: Path) -> list[str]:
    lines = ["| part | status | seconds |", "|---|---|---:|"]
    tsv = out / "parts.tsv"
    for row in tsv.read_text().splitlines() if tsv.is_file() else []:
        name, status, seconds = (row.split("\t") + ["", ""])[:3]
        lines.append(f"| {name} | {status} | {seconds} |")
    return lines


# A sample whose SM clock is under this share of the sitting's highest is "slow" (the card held back).
SLOW_CLOCK = 0.9


def _clock_samples(out: Path) -> list[tuple[datetime, list[str]]]:
    """gpu-clocks.csv's rows (`scripts/gpu_checks.sh`: timestamp, SM clock, its maximum, power, temperature,
    utilisation, clock-event reasons), each with its time; lines that are not samples (an error) are skipped."""
    path, rows = out / "gpu-clocks.csv", []
    for line in path.read_text().splitlines() if path.is_file() else []:
        fields = [f.strip() for f in line.split(",")]
        try:
            rows.append((datetime.strptime(fields[0], "%Y/%m/%d %H:%M:%S.%f"), fields))
        except (ValueError, IndexError):
            continue
    return rows


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:  # "[N/A]"
        return None


def clocks_table(out: Path) -> list[str]:
    """Per part (its start and seconds in parts.tsv): the SM clock's median and lowest, the most power and heat,
    and the clock-event reasons of its slow samples (under SLOW_CLOCK of the sitting's highest clock)."""
    samples = _clock_samples(out)
    clocks = [c for _, f in samples if (c := _number(f[1])) is not None]
    tsv = out / "parts.tsv"
    if not clocks or not tsv.is_file():
        return []
    top = max(clocks)
    lines = ["| part | SM clock MHz, median (lowest) | slow samples | power W, most | temperature C, most "
             "| clock-event reasons while slow |", "|---|---:|---:|---:|---:|---|"]
    for row in tsv.read_text().splitlines():
        fields = row.split("\t")
        if len(fields) < 4:  # a sitting before the start times
            continue
        start = datetime.strptime(fields[3], "%Y/%m/%d %H:%M:%S")
        end = start + timedelta(seconds=float(fields[2] or 0))
        part = [f for t, f in samples if start <= t <= end]
        sm = sorted(c for f in part if (c := _number(f[1])) is not None)
        if not sm:
            continue
        slow = [f for f in part if (c := _number(f[1])) is not None and c < SLOW_CLOCK * top]
        power = max((w for f in part if (w := _number(f[3])) is not None), default=None)
        heat = max((t for f in part if (t := _number(f[4])) is not None), default=None)
        reasons = sorted({f[6] for f in slow if len(f) > 6})
        lines.append(f"| {fields[0]} | {sm[len(sm) // 2]:.0f} ({sm[0]:.0f}) | {len(slow)} of {len(part)} "
                     f"| {'-' if power is None else f'{power:.0f}'} | {'-' if heat is None else f'{heat:.0f}'} "
                     f"| {', '.join(reasons) or '-'} |")
    return lines


def rollout_table(out: Path) -> list[str]:
    lines = []
    for name in ("rollout", "rollout-default"):
        rep = _load(out / f"{name}.json")
        if not rep:
            continue
        if not lines:
            lines = ["| engine | requests | rounds | raw SGLang tok/s | manager tok/s | manager / raw (same engine) |",
                     "|---|---:|---:|---:|---:|---:|"]
        for r in rep.get("rows", []):
            if "direct_tok_s" not in r or "manager_tok_s" not in r:
                if r.get("failures"):  # a size that failed before any complete round still shows
                    lines.append(f"| {r['variant']} | {r['requests']} | {_rounds(r, rep)} | - | - | - |")
                continue
            d, m = r["direct_min_max"], r["manager_min_max"]
            lines.append(f"| {r['variant']} | {r['requests']} | {_rounds(r, rep)} | "
                         f"{r['direct_tok_s']:,.0f} ({d[0]:,.0f}-{d[1]:,.0f}) | "
                         f"{r['manager_tok_s']:,.0f} ({m[0]:,.0f}-{m[1]:,.0f}) | "
                         f"{r['manager_tok_s'] / r['direct_tok_s']:.3f} |")
    return lines


def _rounds(row: dict[str, Any], rep: dict[str, Any]) -> str:
    """Complete rounds of a rollout row out of those asked for, and its failed passes (older reports: "-")."""
    if "rounds" not in row:
        return "-"
    cell = f"{row['rounds']}/{rep.get('repeats', '?')}"
    failed = row.get("failures") or 0
    return cell + (f", {failed} failed pass{'es' if failed > 1 else ''}" if failed else "")


def speed_table(out: Path) -> list[str]:
    rep = _load(out / "speed-recipe.json")
    if not rep:
        return []
    lines = ["| precision | RL / bare (median, rounds min-max) | RL step s | bare step s |", "|---|---:|---:|---:|"]
    for key, res in rep.items():
        if not key.startswith("throughput/") or "rl_over_bare" not in res:
            continue
        rounds = res["rl_over_bare_per_round"]
        lines.append(f"| {key.split('/', 1)[1]} | {res['rl_over_bare']:.3f} ({rounds[0]:.3f}-{rounds[-1]:.3f}) | "
                     f"{res['fixed']['step_s']:.3f} | {res['bare_fixed']['step_s']:.3f} |")
    return lines


def grpo_table(out: Path) -> list[str]:
    lines = []
    for name in GRPO_RUNS:
        rep = _load(out / f"{name}.json")
        if not rep or not rep.get("spread"):
            continue
        if not lines:
            lines = ["| run | steps | step s | generate | train | sync | transitions s | transitions / step | "
                     "trainer state while generating, GiB |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        sp = rep["spread"]
        rows = rep.get("steps", [])[-sp.get("step_s", {}).get("n", 0):] if sp.get("step_s") else []
        shares = sorted(sum(float(r.get(f"{t}_s") or 0.0) for t in TRANSITIONS) / float(r["step_s"])
                        for r in rows if r.get("step_s"))
        moved = sorted(sum(float(r.get(f"{t}_s") or 0.0) for t in TRANSITIONS) for r in rows if r.get("step_s"))
        share = f"{shares[len(shares) // 2]:.1%} ({shares[0]:.1%}-{shares[-1]:.1%})" if shares else "-"
        seconds = f"{moved[len(moved) // 2]:.2f}" if moved else "-"
        lines.append(f"| {name} ({rep.get('status', '?')}) | {len(rep.get('steps', []))} | {_mmm(sp, 'step_s')} | "
                     f"{_mmm(sp, 'generate')} | {_mmm(sp, 'train')} | {_mmm(sp, 'sync')} | {seconds} | {share} | "
                     f"{_mmm(sp, 'generate_state_gib')} |")
    return lines


def push_table(out: Path) -> list[str]:
    """Each GRPO run's push phases (`push_<phase>` in its spread, weight_sync/coordinator.py), in push order."""
    lines = []
    for name in GRPO_RUNS:
        rep = _load(out / f"{name}.json")
        sp = (rep or {}).get("spread") or {}
        phases = [k for k in sp if k.startswith("push_")]
        if not phases:
            continue
        if not lines:
            lines = ["| run | phase | seconds, median (min-max) |", "|---|---|---:|"]
        for key in phases:
            v = sp[key]
            lines.append(f"| {name} | {key[len('push_'):]} | {v['median']:.3f} ({v['min']:.3f}-{v['max']:.3f}) |")
    return lines


def guard_table(out: Path) -> list[str]:
    """The guard's cost per precision, from `guard-7b-<precision>.json` (one process each; or one `guard-7b.json`)."""
    rep: dict[str, Any] = {}
    for path in [out / "guard-7b.json", *sorted(out.glob("guard-7b-*.json"))]:
        rep.update(_load(path) or {})
    if not rep:
        return []
    lines = ["| precision | guard cost (median of rounds) | rounds min-max | a step measuring the norms |",
             "|---|---:|---:|---:|"]
    for key, res in rep.items():
        if key.startswith("guard/") and "on_cost" in res:
            rounds = res["on_cost_per_round"]
            measured = f"{res['measured_cost']:+.1%}" if "measured_cost" in res else "-"
            lines.append(f"| {key.split('/', 1)[1]} | {res['on_cost']:+.1%} | {rounds[0]:+.1%} to {rounds[-1]:+.1%} "
                         f"| {measured} |")
    return lines


def summary(out: Path) -> str:
    sections = [("Parts", parts_table(out)), ("Generation (tokens/s, median (min-max))", rollout_table(out)),
                ("RL step against the bare megatron-core step, recipe shape", speed_table(out)),
                ("GRPO steps (seconds, median (min-max) after the warm-up steps)", grpo_table(out)),
                ("The push's phases", push_table(out)),
                ("Divergence guard at 7B width", guard_table(out)),
                (f"The card's clocks per part (slow: under {SLOW_CLOCK:.0%} of the sitting's highest SM clock)",
                 clocks_table(out))]
    text = ["# GPU sitting"]
    for title, lines in sections:
        if lines:
            text += ["", f"## {title}", "", *lines]
    return "\n".join(text) + "\n"


def main() -> int:
    out = Path(sys.argv[1])
    text = summary(out)
    tmp = out / "summary.md.tmp"
    tmp.write_text(text)
    tmp.replace(out / "summary.md")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
