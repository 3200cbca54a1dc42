"""Per-step scalar sinks: the run's ``metrics.jsonl`` (always), TensorBoard and W&B (optional).

``metrics.jsonl`` is the run's own record and the input of ``miles-lite report``: one JSON object
per line and step, ``{"step": int, "time": unix seconds, <stats key>: number | str, ...}``. List
values (per-completion rewards, request latencies) go to Prometheus histograms and the rollout
table, not here; non-finite numbers are written as ``null`` so every line is strict JSON.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from miles_lite.formats.files import LineLog

if TYPE_CHECKING:  # the config package pulls in Hydra; runtime code needs only the fields
    from miles_lite.config.schema import ObservabilityConfig


METRICS_FILE = "metrics.jsonl"


class Sink(Protocol):
    """Receives each finished step's stats dict."""

    def log(self, step: int, stats: Mapping[str, object]) -> None: ...

    def close(self) -> None: ...


def scalar_stats(stats: Mapping[str, object]) -> dict[str, float | int | str | None]:
    """The scalar entries of `stats` (numbers and strings); NaN/inf become None."""
    out: dict[str, float | int | str | None] = {}
    for key, value in stats.items():
        if isinstance(value, bool):
            out[key] = int(value)
        elif isinstance(value, int | str):
            out[key] = value
        elif isinstance(value, float):
            out[key] = value if math.isfinite(value) else None
        elif hasattr(value, "item") and getattr(value, "ndim", None) == 0:
            # 0-d numpy/torch values: stored as plain floats.
            number = float(value.item())
            out[key] = number if math.isfinite(number) else None
    return out


class MetricsFileSink:
    """Appends one JSON line per step to ``<run_dir>/metrics.jsonl``, each in one write (`LineLog`: an
    interruption never leaves half a line)."""

    def __init__(self, run_dir: str | os.PathLike[str]) -> None:
        self.path = Path(run_dir) / METRICS_FILE
        self._log = LineLog(self.path)

    def log(self, step: int, stats: Mapping[str, object]) -> None:
        record: dict[str, Any] = {"step": step, "time": time.time(), **scalar_stats(stats)}
        self._log.append(json.dumps(record, allow_nan=False))

    def close(self) -> None:
        self._log.close()


# Marks a metrics.jsonl record of an evaluation outside any step (before or after RL): its value is the title.
EVAL_PHASE = "eval_phase"


def read_metrics_file(run_dir: str | os.PathLike[str], evaluations: bool = False) -> list[dict[str, Any]]:
    """The step records of ``<run_dir>/metrics.jsonl`` ordered by step; a re-logged step keeps its last record.
    `evaluations`: instead, the records of evaluations outside any step (with ``eval_phase``), in file order.

    Raises:
        FileNotFoundError: no metrics file in `run_dir`.
        ValueError: a line is not a JSON object with an int ``step`` (the message names the line).
    """
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; is {run_dir} a run directory (experiment.output_dir/run)?")
    by_step: dict[int, dict[str, Any]] = {}
    phases: list[dict[str, Any]] = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                # A crash can cut the last line short; anything earlier is corruption.
                raise ValueError(f"{path}:{lineno} is not JSON ({err.msg})") from err
            if not isinstance(record, dict) or not isinstance(record.get("step"), int):
                raise ValueError(f"{path}:{lineno} must be a JSON object with an integer 'step'")
            if EVAL_PHASE in record:
                phases.append(record)
            else:
                by_step[record["step"]] = record
    return phases if evaluations else [by_step[s] for s in sorted(by_step)]


class TensorBoardSink:
    """Scalars to TensorBoard event files under ``<run_dir>/tensorboard``."""

    def __init__(self, run_dir: str | os.PathLike[str]) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:
            raise ImportError(
                "observability.tensorboard=true needs the 'tensorboard' package: pip install tensorboard "
                "(or set observability.tensorboard=false)") from err
        self._writer = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"))

    def log(self, step: int, stats: Mapping[str, object]) -> None:
        for key, value in scalar_stats(stats).items():
            if isinstance(value, int | float):
                self._writer.add_scalar(key, value, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    """Scalars to a Weights & Biases run (project ``cfg.wandb_project``, name = run name)."""

    def __init__(self, run_dir: str | os.PathLike[str], run_name: str, project: str,
                 config: Mapping[str, Any] | None = None) -> None:
        try:
            import wandb
        except ImportError as err:
            raise ImportError(
                "observability.wandb=true needs the 'wandb' package: pip install wandb "
                "(or set observability.wandb=false)") from err
        self._wandb = wandb
        self._run = wandb.init(project=project, name=run_name, dir=str(run_dir),
                               config=dict(config or {}), reinit=True)

    def log(self, step: int, stats: Mapping[str, object]) -> None:
        values = {k: v for k, v in scalar_stats(stats).items() if isinstance(v, int | float)}
        self._run.log(values, step=step)

    def close(self) -> None:
        self._run.finish()


def build_sinks(cfg: ObservabilityConfig, run_dir: str | os.PathLike[str], run_name: str,
                config: Mapping[str, Any] | None = None) -> list[Sink]:
    """The metrics file sink, plus TensorBoard / W&B when enabled in `cfg`.

    Raises:
        ImportError: a sink is enabled but its package is missing (the message says which and how).
    """
    sinks: list[Sink] = [MetricsFileSink(run_dir)]
    try:
        if cfg.tensorboard:
            sinks.append(TensorBoardSink(run_dir))
        if cfg.wandb:
            sinks.append(WandbSink(run_dir, run_name, cfg.wandb_project, config))
    except BaseException:
        for sink in sinks:
            sink.close()
        raise
    return sinks
