"""PNG plots of a run for the HTML report (matplotlib's Agg canvas; no pyplot global state).

Inputs are the per-step records of ``metrics.jsonl`` (see ``sinks.py``) and the rollout table
(``rollout_table.py``). Each function returns PNG bytes, or None when the run has no data for it,
so the report can say "not recorded" instead of drawing an empty axis.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from typing import Any

import pyarrow as pa
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from miles_lite.observability.metrics import PHASES

Record = dict[str, Any]
_MARKERS = ("o", "s", "^", "D", "v", "x", "+", "*")
_STYLES = ("-", "--", ":", "-.")


def _series(records: Sequence[Record], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of `key`, skipping steps where it is missing or null."""
    steps, values = [], []
    for r in records:
        v = r.get(key)
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v):
            steps.append(int(r["step"]))
            values.append(float(v))
    return steps, values


def _png(fig: Figure) -> bytes:
    FigureCanvasAgg(fig)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    return buf.getvalue()


def _eval_points(records: Sequence[Record], evaluations: Sequence[Record], key: str) -> tuple[list[int], list[float]]:
    """(steps done, value) of an evaluation measure: in a step's record it was measured when the step began
    (after `step - 1` steps); an evaluation's own record (before / after RL) carries the steps done."""
    points = [(s - 1, v) for s, v in zip(*_series(records, key), strict=True)]
    points += list(zip(*_series(evaluations, key), strict=True))
    points.sort()
    return [p[0] for p in points], [p[1] for p in points]


def accuracy_lines(records: Sequence[Record], evaluations: Sequence[Record] = ()
                   ) -> tuple[str, list[tuple[str, list[int], list[float]]]]:
    """The accuracy panel's title and its lines (label, steps, values): the math rewards' exact accuracy of the
    rollouts and the held-out evaluations; for other reward sets the share of rollouts at the reward's maximum,
    overall and per data source, and each evaluation set's avg@k."""
    lines: list[tuple[str, list[int], list[float]]] = []
    if any("reward/exact_accuracy" in r for r in records) or not any("reward/accuracy" in r for r in records):
        lines.append(("rollouts", *_series(records, "reward/exact_accuracy")))
        lines.append(("held-out (greedy)", *_eval_points(records, evaluations, "eval/exact")))
        return "Exact accuracy", [line for line in lines if line[1]]
    lines.append(("rollouts", *_series(records, "reward/accuracy")))
    keys = {k for r in records for k in r}
    for key in sorted(k for k in keys if k.startswith("reward/accuracy/")):
        lines.append((f"rollouts: {key.rsplit('/', 1)[1]}", *_series(records, key)))
    sets = sorted({k for r in [*records, *evaluations] for k in r if k.startswith("eval/") and "/avg@" in k})
    for key in sets:
        lines.append((f"{key[len('eval/'):]}", *_eval_points(records, evaluations, key)))
    return "Accuracy (reward at its maximum)", [line for line in lines if line[1]]


def reward_plot(records: Sequence[Record], evaluations: Sequence[Record] = ()) -> bytes | None:
    """Mean total reward (± std band) per step, and the task's accuracy (`accuracy_lines`): rollouts, and the
    evaluations when run (`evaluations`: the records of the evaluations before and after RL)."""
    steps, mean = _series(records, "reward/mean")
    title, lines = accuracy_lines(records, evaluations)
    if not steps and not lines:
        return None
    fig = Figure(figsize=(9, 3.4))
    ax_r, ax_a = fig.subplots(1, 2)
    if steps:
        ax_r.plot(steps, mean, color="tab:blue", marker=".", label="mean")
        std_by_step = dict(zip(*_series(records, "reward/std"), strict=True))
        if std_by_step:
            lo = [m - std_by_step.get(s, 0.0) for s, m in zip(steps, mean, strict=True)]
            hi = [m + std_by_step.get(s, 0.0) for s, m in zip(steps, mean, strict=True)]
            ax_r.fill_between(steps, lo, hi, color="tab:blue", alpha=0.2, label="± std")
        ax_r.legend(loc="best")
    ax_r.set(title="Total reward", xlabel="step", ylabel="reward")
    for i, (label, xs, ys) in enumerate(lines):
        evaluation = not label.startswith("rollouts")
        ax_a.plot(xs, ys, marker="o" if evaluation else ".", linestyle=_STYLES[i % len(_STYLES)], label=label)
    if lines:
        ax_a.legend(loc="best", fontsize="small")
    ax_a.set(title=title, xlabel="step", ylabel="share", ylim=(-0.02, 1.02))
    for ax in (ax_r, ax_a):
        ax.grid(alpha=0.3)
    return _png(fig)


def mismatch_plot(records: Sequence[Record]) -> bytes | None:
    """Train/rollout mismatch: |logp diff| mean and max, IS ratio raw vs applied, masked fraction."""
    keys = ("mismatch/logp_abs_diff_mean", "mismatch/logp_abs_diff_max", "mismatch/is_raw_mean",
            "mismatch/is_applied_mean", "mismatch/masked_fraction")
    if not any(_series(records, k)[0] for k in keys):
        return None
    fig = Figure(figsize=(13, 3.4))
    ax_d, ax_is, ax_m = fig.subplots(1, 3)
    for key, label in ((keys[0], "mean"), (keys[1], "max")):
        s, v = _series(records, key)
        if s:
            ax_d.plot(s, v, marker=".", label=label)
    if any(v > 0 for k in keys[:2] for v in _series(records, k)[1]):
        ax_d.set_yscale("log")
    ax_d.set(title="|logp diff| trainer vs rollout", xlabel="step", ylabel="nats / token")
    ax_d.legend(loc="best")
    for key, label in ((keys[2], "raw"), (keys[3], "applied")):
        s, v = _series(records, key)
        if s:
            ax_is.plot(s, v, marker=".", label=label)
    ax_is.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax_is.set(title="IS ratio (mean)", xlabel="step", ylabel="ratio")
    ax_is.legend(loc="best")
    s, v = _series(records, keys[4])
    if s:
        ax_m.plot(s, v, color="tab:red", marker=".")
    ax_m.set(title="Masked token share", xlabel="step", ylabel="share", ylim=(-0.02, max([0.1, *v]) * 1.1))
    for ax in (ax_d, ax_is, ax_m):
        ax.grid(alpha=0.3)
    return _png(fig)


def zero_signal_plot(records: Sequence[Record]) -> bytes | None:
    """Share of zero-signal groups (all completions equally rewarded) per step."""
    steps, share = _series(records, "algo/zero_signal_share")
    if not steps:
        return None
    fig = Figure(figsize=(6, 3.2))
    ax = fig.subplots()
    ax.bar(steps, share, color="tab:orange", width=0.8)
    ax.set(title="Zero-signal groups", xlabel="step", ylabel="share of groups", ylim=(0, 1.02))
    ax.grid(alpha=0.3, axis="y")
    return _png(fig)


def phase_plot(records: Sequence[Record]) -> bytes | None:
    """Seconds per phase of each step, stacked."""
    series = {p: dict(zip(*_series(records, f"time/{p}_seconds"), strict=True)) for p in PHASES}
    series = {p: s for p, s in series.items() if s}
    if not series:
        return None
    steps = sorted({s for values in series.values() for s in values})
    fig = Figure(figsize=(7, 3.2))
    ax = fig.subplots()
    bottom = [0.0] * len(steps)
    for phase, values in series.items():
        heights = [values.get(s, 0.0) for s in steps]
        ax.bar(steps, heights, bottom=bottom, label=phase, width=0.8)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    ax.set(title="Step time by phase", xlabel="step", ylabel="seconds")
    ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize="small")
    ax.grid(alpha=0.3, axis="y")
    return _png(fig)


def reward_functions_plot(table: pa.Table) -> bytes | None:
    """Mean of each reward function per step, from the rollout table's ``rewards`` map."""
    if table.num_rows == 0:
        return None
    sums: dict[str, dict[int, list[float]]] = {}
    for step, rewards in zip(table["step"].to_pylist(), table["rewards"].to_pylist(), strict=True):
        for name, value in rewards or []:
            if value is not None and math.isfinite(value):
                sums.setdefault(name, {}).setdefault(step, []).append(value)
    if not sums:
        return None
    fig = Figure(figsize=(9, 3.6))
    ax = fig.subplots()
    for i, name in enumerate(sorted(sums)):
        steps = sorted(sums[name])
        # Functions often agree exactly (e.g. exact and correctness checks): vary style so none hides.
        ax.plot(steps, [sum(sums[name][s]) / len(sums[name][s]) for s in steps], label=name,
                marker=_MARKERS[i % len(_MARKERS)], linestyle=_STYLES[i % len(_STYLES)],
                markersize=7 - (i % 3) * 2, alpha=0.85)
    ax.set(title="Reward functions (mean per step, unweighted)", xlabel="step", ylabel="raw score")
    ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize="small")
    ax.grid(alpha=0.3)
    return _png(fig)
