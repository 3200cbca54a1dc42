"""`miles-lite report RUN_DIR`: one self-contained HTML page about a run.

Reads the run's ``metrics.jsonl`` (one record per step) and its rollout table (``rollouts/``) and
writes ``RUN_DIR/report.html`` (or ``--out``): reward, accuracy and train/rollout mismatch curves,
zero-signal share, step time by phase, reward functions, and the best and worst completions. The
plots are embedded as base64 PNGs, so the file can be mailed or attached to a ticket as it is.
"""

from __future__ import annotations

import argparse
import base64
import html
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa

from miles_lite.formats.files import write_atomic
from miles_lite.observability import plots
from miles_lite.observability.rollout_table import read_rollouts
from miles_lite.observability.sinks import EVAL_PHASE, read_metrics_file

REPORT_FILE = "report.html"
# Stats shown in the summary table: (key, label, format).
_SUMMARY = (
    ("reward/mean", "reward mean", "{:.3f}"),
    ("reward/exact_accuracy", "exact accuracy", "{:.3f}"),
    ("reward/accuracy", "accuracy (reward at its maximum)", "{:.3f}"),
    ("eval/exact", "held-out exact (greedy)", "{:.3f}"),
    ("algo/zero_signal_share", "zero-signal share", "{:.3f}"),
    ("mismatch/logp_abs_diff_mean", "|logp diff| mean (nats)", "{:.5f}"),
    ("mismatch/logp_abs_diff_max", "|logp diff| max (nats)", "{:.4f}"),
    ("mismatch/is_raw_mean", "IS ratio raw (mean)", "{:.4f}"),
    ("mismatch/is_applied_mean", "IS ratio applied (mean)", "{:.4f}"),
    ("mismatch/masked_fraction", "masked fraction", "{:.4f}"),
    ("rollout/tokens_per_second", "rollout tokens/s", "{:.0f}"),
)
_CSS = """
body{font-family:system-ui,sans-serif;margin:2em;max-width:1400px;color:#222}
h1{margin-bottom:0}.sub{color:#666;margin-top:.2em}
table{border-collapse:collapse;margin:1em 0;font-size:.9em}
td,th{border:1px solid #ccc;padding:.3em .6em;vertical-align:top;text-align:left}
th{background:#f3f3f3}pre{white-space:pre-wrap;margin:0;max-width:60em;font-size:.85em}
img{max-width:100%;border:1px solid #eee;margin:.5em 0}.missing{color:#999;font-style:italic}
"""


def _img(png: bytes | None, alt: str) -> str:
    if png is None:
        return f'<p class="missing">{html.escape(alt)}: not recorded in this run</p>'
    data = base64.b64encode(png).decode("ascii")
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'


def _fmt(value: Any, fmt: str) -> str:
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return fmt.format(value)
    return "-"


def _summary_rows(records: Sequence[dict[str, Any]]) -> list[tuple[str, str, str]]:
    """`_SUMMARY`, with the task's accuracy per data source and the mean reward per source where recorded."""
    keys = {k for r in records for k in r}
    rows = list(_SUMMARY)
    at = next(i for i, row in enumerate(rows) if row[0] == "reward/accuracy") + 1
    for prefix, label in (("reward/accuracy/", "accuracy"), ("reward/mean/", "reward mean")):
        for key in sorted(k for k in keys if k.startswith(prefix)):
            rows.insert(at, (key, f"{label}: {key[len(prefix):]}", "{:.3f}"))
            at += 1
    # One accuracy per task: the math rewards' exact share, or the reward at its maximum.
    return [row for row in rows if row[0] in keys or row[0] not in ("reward/exact_accuracy", "reward/accuracy")]


def _summary_table(records: Sequence[dict[str, Any]]) -> str:
    first, last = records[0], records[-1]
    rows = "".join(
        f"<tr><td>{html.escape(label)}</td><td>{_fmt(first.get(key), fmt)}</td><td>{_fmt(last.get(key), fmt)}</td></tr>"
        for key, label, fmt in _summary_rows(records))
    return (f"<table><tr><th>metric</th><th>step {first['step']}</th><th>step {last['step']}</th></tr>"
            f"{rows}</table>")


def _eval_sets_table(run_dir: Path, records: Sequence[dict[str, Any]]) -> str:
    """Every evaluation set's measures: before RL, at each step that evaluated, after RL."""
    rows = [(r[EVAL_PHASE], r) for r in read_metrics_file(run_dir, evaluations=True)]
    # A step's record holds the evaluation it began with: on the weights of the steps before it.
    rows += [(f"after {r['step'] - 1} RL steps", r) for r in records if any(_is_set_key(k) for k in r)]
    rows.sort(key=lambda row: row[1]["step"] + (0.5 if row[0] == "after RL" else 0))
    keys = sorted({k for _, r in rows for k in r if _is_set_key(k)})
    if not keys:
        return ""
    head = "".join(f"<th>{html.escape(k[len('eval/'):])}</th>" for k in keys)
    body = "".join(f"<tr><td>{html.escape(title)}</td>" + "".join(f"<td>{_fmt(r.get(k), '{:.3f}')}</td>"
                                                                  for k in keys) + "</tr>" for title, r in rows)
    return f"<h2>Evaluation sets</h2><table><tr><th>when</th>{head}</tr>{body}</table>"


def _is_set_key(key: str) -> bool:
    return key.startswith("eval/") and key.count("/") == 2


def _rollout_rows(table: pa.Table, indices: Sequence[int]) -> str:
    cols = {name: table[name].to_pylist() for name in
            ("step", "prompt", "completion", "rewards", "total", "finish_reason", "length", "engine")}
    out = []
    for i in indices:
        rewards = ", ".join(f"{k}={_fmt(v, '{:.3g}')}" for k, v in (cols["rewards"][i] or []))
        out.append(
            f"<tr><td>{cols['step'][i]}</td><td>{_fmt(cols['total'][i], '{:.3f}')}</td>"
            f"<td>{html.escape(rewards)}</td><td>{html.escape(str(cols['finish_reason'][i]))}, "
            f"{cols['length'][i]} tok, {html.escape(str(cols['engine'][i]))}</td>"
            f"<td><pre>{html.escape(str(cols['prompt'][i])[-600:])}</pre></td>"
            f"<td><pre>{html.escape(str(cols['completion'][i]))}</pre></td></tr>")
    head = ("<tr><th>step</th><th>total</th><th>rewards</th><th>finish</th><th>prompt (end)</th>"
            "<th>completion</th></tr>")
    return f"<table>{head}{''.join(out)}</table>"


def best_and_worst(table: pa.Table, k: int) -> tuple[list[int], list[int]]:
    """Row indices of the `k` highest and `k` lowest total rewards (ties: the later step first)."""
    totals = table["total"].to_pylist()
    steps = table["step"].to_pylist()
    valid = [i for i, t in enumerate(totals) if t is not None and math.isfinite(t)]
    best = sorted(valid, key=lambda i: (-totals[i], -steps[i]))[:k]
    worst = sorted(valid, key=lambda i: (totals[i], -steps[i]))[:k]
    return best, worst


def render_report(run_dir: str | os.PathLike[str], top_k: int = 5) -> str:
    """The report of `run_dir` as an HTML string.

    Raises:
        FileNotFoundError: the directory has no ``metrics.jsonl``.
        ValueError: ``metrics.jsonl`` exists but holds no step.
    """
    run_dir = Path(run_dir)
    records = read_metrics_file(run_dir)
    if not records:
        raise ValueError(f"{run_dir / 'metrics.jsonl'} holds no step; the run has not finished a step yet")
    table = read_rollouts(run_dir)
    parts = [
        f"<!doctype html><html><head><meta charset='utf-8'><title>miles-lite report: {html.escape(run_dir.name)}"
        f"</title><style>{_CSS}</style></head><body>",
        f"<h1>{html.escape(run_dir.name)}</h1>",
        f"<p class='sub'>{len(records)} steps (step {records[0]['step']} to {records[-1]['step']}), "
        f"{table.num_rows} completions in the rollout table</p>",
        "<h2>Summary</h2>", _summary_table(records), _eval_sets_table(run_dir, records),
        "<h2>Reward and accuracy</h2>",
        _img(plots.reward_plot(records, read_metrics_file(run_dir, evaluations=True)), "reward and accuracy"),
        "<h2>Train / rollout mismatch</h2>", _img(plots.mismatch_plot(records), "mismatch"),
        "<h2>Zero-signal groups</h2>", _img(plots.zero_signal_plot(records), "zero-signal share"),
        "<h2>Step time</h2>", _img(plots.phase_plot(records), "step time by phase"),
        "<h2>Reward functions</h2>", _img(plots.reward_functions_plot(table), "reward functions"),
    ]
    if table.num_rows:
        best, worst = best_and_worst(table, top_k)
        parts += [f"<h2>Best {len(best)} completions</h2>", _rollout_rows(table, best),
                  f"<h2>Worst {len(worst)} completions</h2>", _rollout_rows(table, worst)]
    else:
        parts.append('<p class="missing">No rollout table in this run (observability.rollout_table=false).</p>')
    parts.append("</body></html>")
    return "\n".join(parts)


def write_report(run_dir: str | os.PathLike[str], out: str | os.PathLike[str] | None = None,
                 top_k: int = 5) -> Path:
    """Render and write the report; returns its path (default ``RUN_DIR/report.html``)."""
    path = Path(out) if out is not None else Path(run_dir) / REPORT_FILE
    write_atomic(path, render_report(run_dir, top_k))
    return path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `miles-lite report`."""
    parser.add_argument("run_dir", help="run directory holding metrics.jsonl (and rollouts/)")
    parser.add_argument("--out", default=None, help="output HTML file (default: RUN_DIR/report.html)")
    parser.add_argument("--top", type=int, default=5, help="how many best and worst completions to show")


def run(args: argparse.Namespace) -> int:
    """Entry point of `miles-lite report`; returns the exit code (2 on a bad run directory)."""
    if args.top < 0:
        print(f"--top must be >= 0, got {args.top}")
        return 2
    try:
        path = write_report(args.run_dir, args.out, args.top)
    except (FileNotFoundError, ValueError) as err:
        print(f"miles-lite report: {err}")
        return 2
    print(f"wrote {path}")
    return 0
