"""Console progress of a run: a rich progress bar over the steps and one summary line per step.

The summary line reads the same stats keys as ``metrics.publish_step`` (see the table there), e.g.::

    step 12/200 | reward 2.41 | exact 0.38 | zero-signal 0.25 | logp diff 0.0031 |
    IS raw 1.002 / applied 0.998 / masked 0.004 | sync 0.84s | 1520 tok/s

The task's accuracy is `exact` (the math rewards' exact answer and format) or, with any other reward set,
`accuracy` (the share of samples whose reward reached its maximum) with each data source's in brackets
(`accuracy 0.62 (reverse 0.70, sort 0.55)`). Missing keys print as ``-`` rather than a made-up zero.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

# (label, stats key, format) in the order of the summary line.
_FIELDS: tuple[tuple[str, str, str], ...] = (
    ("reward", "reward/mean", "{:.3f}"),
    ("exact", "reward/exact_accuracy", "{:.2f}"),
    ("zero-signal", "algo/zero_signal_share", "{:.2f}"),
    ("logp diff", "mismatch/logp_abs_diff_mean", "{:.4f}"),
    ("IS raw", "mismatch/is_raw_mean", "{:.3f}"),
    ("applied", "mismatch/is_applied_mean", "{:.3f}"),
    ("masked", "mismatch/masked_fraction", "{:.3f}"),
    ("sync", "time/sync_seconds", "{:.2f}s"),
    ("tok/s", "rollout/tokens_per_second", "{:.0f}"),
)


def _fmt(stats: Mapping[str, object], key: str, fmt: str) -> str:
    value = stats.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return "-"
    if not math.isfinite(value):
        return str(value)
    return fmt.format(value)


def _accuracy(stats: Mapping[str, object], exact: str) -> str:
    """`exact X` (math rewards), else `accuracy X (source Y, ...)` (reward at its maximum), else `exact -`."""
    if "reward/exact_accuracy" in stats or "reward/accuracy" not in stats:
        return f"exact {exact}"
    prefix = "reward/accuracy/"
    sources = [f"{k[len(prefix):]} {_fmt(stats, k, '{:.2f}')}" for k in sorted(stats) if k.startswith(prefix)]
    return f"accuracy {_fmt(stats, 'reward/accuracy', '{:.2f}')}" + (f" ({', '.join(sources)})" if sources else "")


def format_summary(step: int, total_steps: int, stats: Mapping[str, object]) -> str:
    """The one-line summary of `step` (plain text, no markup)."""
    parts = [f"step {step}/{total_steps}"]
    values = {label: _fmt(stats, key, fmt) for label, key, fmt in _FIELDS}
    parts.append(f"reward {values['reward']}")
    parts.append(_accuracy(stats, values["exact"]))
    parts.append(f"zero-signal {values['zero-signal']}")
    parts.append(f"logp diff {values['logp diff']}")
    parts.append(f"IS raw {values['IS raw']} / applied {values['applied']} / masked {values['masked']}")
    parts.append(f"sync {values['sync']}")
    parts.append(f"{values['tok/s']} tok/s")
    return " | ".join(parts)


class RunProgress:
    """Progress bar over `total_steps` plus a printed summary line per step.

    Use as a context manager; :meth:`step_done` after each step. With `enabled=False` only the
    summary lines are printed (for logs that are not a terminal, set a non-terminal console).
    """

    def __init__(self, total_steps: int, *, first_step: int = 0, console: Console | None = None,
                 enabled: bool = True) -> None:
        if total_steps < 1:
            raise ValueError(f"experiment.steps must be >= 1 for a progress bar, got {total_steps}")
        self.total_steps = total_steps
        # soft_wrap: a line longer than the console (80 columns when piped to a file) stays one line.
        self.console = console or Console(stderr=True, soft_wrap=True)
        self._progress = Progress(
            TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            TimeRemainingColumn(), console=self.console, disable=not enabled, transient=False)
        self._task = self._progress.add_task("train", total=total_steps, completed=first_step)
        self.lines: list[str] = []

    def __enter__(self) -> RunProgress:
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()

    def step_done(self, step: int, stats: Mapping[str, object]) -> str:
        """Advance the bar to `step` (1-based count of finished steps) and print its summary line."""
        line = format_summary(step, self.total_steps, stats)
        self.lines.append(line)
        # Printing through the Progress console keeps the bar below the scrolling lines.
        self._progress.console.print(line, markup=False, highlight=False)
        self._progress.update(self._task, completed=min(step, self.total_steps))
        return line
