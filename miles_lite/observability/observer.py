"""`RunObserver`: the driver's one call per step, fanning out to every observability output.

``observer.publish(step, stats, groups)`` updates the Prometheus registry, appends to
``metrics.jsonl`` (and TensorBoard / W&B when enabled), writes the step's rollout table and prints
the progress line, as ``observability.*`` configures.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console

from miles_lite.observability.exporter import MetricsExporter, start_exporter
from miles_lite.observability.gpu import nvml_collector
from miles_lite.observability.metrics import MetricsRegistry
from miles_lite.observability.progress import RunProgress
from miles_lite.observability.rollout_table import RolloutTableWriter
from miles_lite.observability.sinks import Sink, build_sinks
from miles_lite.types import Group

if TYPE_CHECKING:  # the config package pulls in Hydra; runtime code needs only the fields
    from miles_lite.config.schema import ObservabilityConfig


class ObserverState(enum.Enum):
    """Lifecycle: NEW -> OPEN -> CLOSED."""

    NEW = "new"
    OPEN = "open"
    CLOSED = "closed"


class RunObserver:
    """All observability outputs of one run, for the process of `role`.

    Args:
        cfg: ``cfg.observability``.
        run_dir: the run's output directory (``metrics.jsonl``, ``rollouts/`` go there).
        run_name: the ``run`` label and sink run name.
        total_steps: steps of the run (progress bar length).
        first_step: steps already done (after a resume).
        config: the resolved job config, recorded by W&B.
        console: where progress goes (stderr by default).
    """

    def __init__(self, cfg: ObservabilityConfig, run_dir: str | os.PathLike[str], run_name: str,
                 total_steps: int, *, role: str = "driver", first_step: int = 0,
                 config: Mapping[str, Any] | None = None, console: Console | None = None) -> None:
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.run_name = run_name
        self.registry = MetricsRegistry(run_name, role)
        self._total_steps = total_steps
        self._first_step = first_step
        self._config = config
        self._console = console
        self.exporter: MetricsExporter | None = None
        self.sinks: list[Sink] = []
        self.table: RolloutTableWriter | None = None
        self.progress: RunProgress | None = None
        self.state = ObserverState.NEW

    def open(self) -> RunObserver:
        """Start the exporter (if enabled), sinks, rollout table and progress bar."""
        if self.state is not ObserverState.NEW:
            raise RuntimeError(f"RunObserver is {self.state.value}; create a new one per run")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        gpu = nvml_collector(self.run_name, self.registry.role)
        if gpu is not None:
            self.registry.register_collector(gpu)
        try:
            self.exporter = start_exporter(self.registry, self.cfg)
            self.sinks = build_sinks(self.cfg, self.run_dir, self.run_name, self._config)
            if self.cfg.rollout_table:
                self.table = RolloutTableWriter(self.run_dir)
            self.progress = RunProgress(self._total_steps, first_step=self._first_step, console=self._console,
                                        enabled=self.cfg.progress)
            self.progress.__enter__()
        except BaseException:
            self._release()
            raise
        self.state = ObserverState.OPEN
        return self

    def publish(self, step: int, stats: Mapping[str, object], groups: Sequence[Group] = ()) -> str:
        """Record one finished step everywhere; returns the progress summary line.

        Args:
            step: the optimizer step just finished (1-based count of finished steps).
            stats: the step's stats dict (keys: see ``metrics.py``).
            groups: the step's scored groups, for the rollout table.
        """
        if self.state is not ObserverState.OPEN or self.progress is None:
            raise RuntimeError(f"RunObserver is {self.state.value}; call open() before publish()")
        self.registry.publish_step(step, stats)
        for sink in self.sinks:
            sink.log(step, stats)
        if self.table is not None and groups:
            self.table.write_groups(step, groups)
        return self.progress.step_done(step, stats)

    def _release(self) -> None:
        if self.progress is not None:
            self.progress.__exit__(None, None, None)
        for sink in self.sinks:
            sink.close()
        if self.exporter is not None:
            self.exporter.stop()

    def close(self, linger: bool = False) -> None:
        """Stop the exporter and close sinks and progress; a no-op once closed.

        `linger`: first keep serving until a scrape has read the final values, at most
        ``observability.linger_s`` seconds (the context manager lingers when the block ended normally).
        """
        if self.state is ObserverState.OPEN:
            if linger and self.exporter is not None and self.cfg.linger_s > 0:
                self.exporter.wait_for_scrape(self.cfg.linger_s)
            self._release()
        self.state = ObserverState.CLOSED

    def __enter__(self) -> RunObserver:
        return self.open()

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        self.close(linger=exc_type is None)
