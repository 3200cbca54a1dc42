"""Observability: Prometheus metrics and exporter, rollout table, metrics file and sinks, progress, report.

The HTML report (`report.py`, `plots.py`) is not imported here so that training processes do not
load matplotlib. A role: it may import `config`, `net` and the shared types; the run layer feeds it.
"""

from miles_lite.observability.exporter import ExporterState, MetricsExporter, start_exporter
from miles_lite.observability.gpu import NvmlCollector, nvml_collector
from miles_lite.observability.metrics import ENGINE_STATES, PHASES, ROLES, STEP_KEYS, MetricsRegistry
from miles_lite.observability.progress import RunProgress, format_summary
from miles_lite.observability.rollout_table import (
    RolloutRow,
    RolloutTableWriter,
    read_rollouts,
    rows_from_groups,
)
from miles_lite.observability.sinks import (
    METRICS_FILE,
    MetricsFileSink,
    Sink,
    TensorBoardSink,
    WandbSink,
    build_sinks,
    read_metrics_file,
)

__all__ = [
    "ENGINE_STATES",
    "METRICS_FILE",
    "PHASES",
    "ROLES",
    "STEP_KEYS",
    "ExporterState",
    "MetricsExporter",
    "MetricsFileSink",
    "MetricsRegistry",
    "NvmlCollector",
    "RolloutRow",
    "RolloutTableWriter",
    "RunProgress",
    "Sink",
    "TensorBoardSink",
    "WandbSink",
    "build_sinks",
    "format_summary",
    "nvml_collector",
    "read_metrics_file",
    "read_rollouts",
    "rows_from_groups",
    "start_exporter",
]
