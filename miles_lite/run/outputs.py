"""Everything a run writes and exports: metrics (Prometheus + metrics.jsonl + optional sinks), rollout
tables, progress lines, evaluation tables, checkpoints and the final summary with its curves."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any

from miles_lite.checkpoint.commit_watch import CommitWatcher
from miles_lite.checkpoint.driver_state import DriverState, capture_driver_rng
from miles_lite.checkpoint.resume import set_aside_newer
from miles_lite.cluster.role import TrainerRole
from miles_lite.config.schema import MilesConfig
from miles_lite.evaluation.greedy import EvalResult
from miles_lite.formats.files import write_atomic
from miles_lite.observability.exporter import MetricsExporter, start_exporter
from miles_lite.observability.gpu import nvml_collector
from miles_lite.observability.metrics import ENGINE_STATES, MetricsRegistry
from miles_lite.observability.progress import RunProgress
from miles_lite.observability.rollout_table import RolloutTableWriter
from miles_lite.observability.sinks import EVAL_PHASE, build_sinks
from miles_lite.timing import PhaseTimer
from miles_lite.types import Group
from miles_lite.weight_sync.coordinator import SyncReport


def checkpoint_root(cfg: MilesConfig, run_dir: Path) -> Path:
    """Where the run's checkpoints go: `checkpoint.dir`, else `<run_dir>/checkpoints`."""
    return Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else run_dir / "checkpoints"


def finished_summary(cfg: MilesConfig, run_dir: Path) -> dict[str, Any] | None:
    """The summary of a run in `run_dir` that already did `experiment.steps` steps, or None.

    Finished means: `summary.json` records at least `experiment.steps` steps and, with
    `checkpoint.resume=auto`, the run's newest intact checkpoint is of that step or later (so the
    configuration asks for nothing the run has not done). A re-run, e.g. a requeue after completion,
    is then a no-op.
    """
    from miles_lite.checkpoint.layout import list_step_dirs
    from miles_lite.checkpoint.resume import newest_intact

    path = run_dir / "summary.json"
    if cfg.checkpoint.resume != "auto" or not path.is_file():
        return None
    try:
        summary = json.loads(path.read_text())
        done = int(summary["steps_done"])
    except (ValueError, KeyError, TypeError):
        return None
    root = checkpoint_root(cfg, run_dir)
    if done < cfg.experiment.steps or not any(step >= cfg.experiment.steps for step, _ in list_step_dirs(root)):
        return None
    newest = newest_intact(root)
    if newest is None or int(newest.name.split("_")[-1]) < cfg.experiment.steps:
        return None
    return summary


class RunIO:
    """Outputs of one run under `run_dir`; a context manager that starts and stops the exporter."""

    def __init__(self, cfg: MilesConfig, run_dir: Path, run_name: str,
                 record: Mapping[str, Any] | None = None) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        # What every checkpoint records of the run: `config` (the resolved configuration) and `data`
        # (the identity of the data the prompt cursor indexes).
        self.record = dict(record or {})
        self.metrics = MetricsRegistry(run_name, "driver")
        gpu = nvml_collector(run_name, "driver")
        if gpu is not None:  # GPU series only where NVML sees a GPU (absent on CPU, never zeros)
            self.metrics.register_collector(gpu)
        self.exporter = start_exporter(self.metrics, cfg.observability)
        if self.exporter is not None:
            print(f"miles-lite: Prometheus metrics at {self.exporter.url}", flush=True)
        self.sinks = build_sinks(cfg.observability, run_dir, run_name)
        self.table = RolloutTableWriter(run_dir) if cfg.observability.rollout_table else None
        self.progress = RunProgress(max(cfg.experiment.steps, 1), enabled=cfg.observability.progress)
        self.last_sync: dict[str, float] = {}
        self.evals: dict[str, dict[str, float]] = {}
        # The evaluations before RL (`summary.json`'s `before`): every checkpoint carries them to a resume.
        self.before: dict[str, float] = {}
        self._restarts_seen = 0.0
        # The rollout table of the step being pushed, written meanwhile (`start_rollout_table`).
        self._table_thread: ThreadPoolExecutor | None = None
        self._table_write: tuple[int, Future[Any]] | None = None
        # `miles_lite_checkpoint_step` follows the commits of background saves too (whichever process commits).
        self.commits = (CommitWatcher(cfg.checkpoint.dir, self.metrics.checkpoint_step)
                        if cfg.checkpoint.dir else None)

    def __enter__(self) -> RunIO:
        self.progress.__enter__()
        if self.commits is not None:
            self.commits.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if self._table_thread is not None:  # a step that failed after its table was started still gets it
            self._table_thread.shutdown(wait=True)
        if self.commits is not None:
            self.commits.stop()
        self.progress.__exit__(exc_type, *exc)
        for sink in self.sinks:
            sink.close()
        if self.exporter is not None:
            if exc_type is None:
                self._linger(self.exporter)
            self.exporter.stop()

    def _linger(self, exporter: MetricsExporter) -> None:
        """After a finished run, serve until a scrape has read the final values (`observability.linger_s`)."""
        linger_s = self.cfg.observability.linger_s
        if linger_s <= 0:
            return
        self.log(f"miles-lite: waiting up to {linger_s:g} s for a scrape of the final metrics at {exporter.url}")
        if not exporter.wait_for_scrape(linger_s):
            self.log(f"miles-lite: no scrape within observability.linger_s={linger_s:g} s; stopping the exporter")

    def timer(self) -> PhaseTimer:
        return PhaseTimer()

    def log(self, message: str) -> None:
        self.progress.console.print(message, markup=False, highlight=False)

    # ---- per-step ---------------------------------------------------------------------------------

    def report_sync(self, report: SyncReport, seconds: float) -> None:
        """Record one weight push (transport, bytes, seconds, probe diff) for metrics and the next step line."""
        probe = report.verify.logp_diff_mean if report.verify is not None else None
        transport = self.cfg.weight_sync.transport
        self.metrics.sync_done(transport, seconds, int(report.push.bytes), int(report.push.version or 0)
                               if str(report.push.version).isdigit() else 0, probe)
        self.last_sync = {"sync/seconds": seconds, "sync/bytes": float(report.push.bytes),
                          "sync/gb_per_s": report.push.gb_per_s, "sync/paused_seconds": report.paused_s,
                          **{f"sync/phase_{k}_seconds": v for k, v in report.phases.items()}}
        if probe is not None:
            self.last_sync["sync/probe_logp_diff_mean"] = probe
            self.last_sync["sync/probe_logp_diff_max"] = report.verify.logp_diff_max
            self.last_sync["sync/probe_logp_diff_bound"] = report.verify.bound

    def publish_step(self, step: int, stats: dict[str, Any], groups: Sequence[Group],
                     fleet_stats: Mapping[str, float]) -> None:
        """Metrics, metrics.jsonl, the rollout table and the progress line of finished step `step` (counted from
        1 everywhere: the console's `step N/M`, `metrics.jsonl`, `rollouts/step_N`, checkpoint `step_N`)."""
        stats = {**stats, **self.last_sync, **{f"fleet/{k}": v for k, v in fleet_stats.items()}}
        self.metrics.publish_step(step, stats)
        self.metrics.set_engine_states({state: int(fleet_stats.get(f"engines_{state}", 0))
                                        for state in ENGINE_STATES})
        restarts = float(fleet_stats.get("restarts", 0.0))
        # Also at 0: a healthy fleet's restart counter exists (and reads 0) rather than being absent.
        self.metrics.engine_restarted(max(0, int(restarts - self._restarts_seen)))
        self._restarts_seen = max(restarts, self._restarts_seen)
        for sink in self.sinks:
            sink.log(step, stats)
        if self._table_write is not None and self._table_write[0] == step:
            written, self._table_write = self._table_write[1], None
            written.result()  # re-raises what the write raised
        elif self.table is not None:
            self.table.write_groups(step, groups)
        self.progress.step_done(step, stats)

    def start_rollout_table(self, step: int, groups: Sequence[Group]) -> None:
        """Start writing step `step`'s rollout table on a thread of its own; `publish_step(step, ...)` waits for
        it. Started before the weight push, whose waits on the engines (their load, their probe scores) leave
        the driver's interpreter idle: the Parquet file is written there instead of after the push."""
        if self.table is None:
            return
        if self._table_thread is None:
            self._table_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout-table")
        self._table_write = (step, self._table_thread.submit(self.table.write_groups, step, groups))

    def report_eval_sets(self, title: str, results: Sequence[Any], step: int, *, in_step: bool = False
                         ) -> dict[str, float]:
        """Print each evaluation set's table and return their `eval/<set>/<measure>` stats. Outside a step
        (before and after RL) they also go to Prometheus and to metrics.jsonl as a record of their own
        (`eval_phase`: the title); inside one they join that step's record."""
        stats: dict[str, float] = {}
        for result in results:
            self.log(result.table(title))
            stats.update(result.stats())
        if stats and not in_step:
            self.metrics.set_eval_sets(stats)
            for sink in self.sinks:
                sink.log(step, {EVAL_PHASE: title, **stats})
            self.evals[title] = {**self.evals.get(title, {}), **stats}
        return stats

    def report_eval(self, title: str, result: EvalResult) -> dict[str, float]:
        self.log(result.table(title))
        self.evals[title] = result.as_dict()
        return result.as_dict()

    # ---- checkpoints --------------------------------------------------------------------------------

    def resume(self, system: Any, path: Path | None) -> DriverState | None:
        """Load checkpoint `path` (what `checkpoint.resume` selected, None: none) into `system.trainer` (any
        TP/DP); the driver state it holds (None: a fresh run, or an initial checkpoint with weights only).
        Pushes nothing.

        Checkpoints in `checkpoint.dir` newer than the one resumed (a roll-back, or damaged ones passed
        over) are moved aside, so that the run's own later checkpoints are the ones auto-resume and
        retention see.
        """
        if path is None:
            return None
        trainer: TrainerRole = system.trainer
        driver = trainer.restore_checkpoint(str(path))
        step = driver.step if driver is not None else 0
        if self.cfg.checkpoint.dir:
            set_aside_newer(self.cfg.checkpoint.dir, step, self.log)
            if path.parent.resolve() == Path(self.cfg.checkpoint.dir).resolve():
                # This step's checkpoint exists where the run writes: a final save at this step is skipped.
                system.last_checkpoint_step = step
        if driver is None:
            self.log(f"checkpoint {path}: weights loaded (no driver state: an initial checkpoint); starting at step 0")
        else:
            self.log(f"resumed from {path} at step {driver.step} (weight version {driver.weight_version})")
        return driver

    def checkpoint_due(self, steps_done: int) -> bool:
        """Whether `maybe_save_checkpoint` saves after `steps_done` steps (every `checkpoint.interval`, where
        `checkpoint.dir` is set)."""
        interval = self.cfg.checkpoint.interval
        return bool(self.cfg.checkpoint.dir and interval and steps_done % interval == 0)

    def maybe_save_checkpoint(self, system: Any, data: Any, steps_done: int) -> None:
        """`save_checkpoint` every `checkpoint.interval` steps."""
        if self.checkpoint_due(steps_done):
            self.save_checkpoint(system, data, steps_done)

    def save_checkpoint(self, system: Any, data: Any, steps_done: int, final: bool = False) -> None:
        """Checkpoint the run after `steps_done` steps (nothing when `checkpoint.dir` is unset).

        Every trainer rank snapshots its own shards through its role's checkpointer and returns to
        training while the flush runs; rank 0 adds the driver state (step, weight version, data cursor,
        RNG) and commits. `data`: what `PromptSource.state_dict` gives the cursor; `final` waits for the
        commit (end of run).
        """
        if not self.cfg.checkpoint.dir:
            return
        trainer = system.trainer
        if final and system.last_checkpoint_step == steps_done:
            # The periodic save already took this step: only wait for its commit.
            stats = trainer.finalize_checkpoint()
        else:
            driver = DriverState(step=steps_done, weight_version=int(system.version), data=data.state_dict(),
                                 rng=capture_driver_rng(), run_config=self.record.get("config"),
                                 data_identity=self.record.get("data"), extra={"before": dict(self.before)})
            stats = trainer.save_checkpoint(steps_done, driver, final)
            system.last_checkpoint_step = steps_done
            self.metrics.checkpoint_blocked(stats.blocked_s)
        if stats is not None and stats.flush_s is not None:
            self.metrics.checkpoint_committed(stats.flush_s, int(stats.total_bytes or stats.bytes), stats.step)
        if stats is not None and final:
            self.log(f"checkpoint step {steps_done}: {stats.path} (training blocked {stats.blocked_s:.2f} s)"
                     + ("; it replaced an older checkpoint of that step" if stats.replaced else ""))
        elif final and self.cfg.checkpoint.dir:
            self.log(f"checkpoint step {steps_done} already exists (the run resumed from it): not written again")

    # ---- the end ------------------------------------------------------------------------------------

    def finish(self, summary: Any, quiet: bool = False) -> None:
        """Write summary.json and the reward/accuracy curves PNG (`quiet`: without the closing lines)."""
        data = asdict(summary)
        write_atomic(self.run_dir / "summary.json", json.dumps(data, indent=2))
        from miles_lite.observability.plots import reward_plot
        from miles_lite.observability.sinks import read_metrics_file

        png = reward_plot(read_metrics_file(self.run_dir), read_metrics_file(self.run_dir, evaluations=True))
        if png is not None:
            write_atomic(self.run_dir / "curves.png", png)
        before, after = summary.before.get("exact"), summary.after.get("exact")
        if quiet:
            return
        if before is not None and after is not None:
            self.log(f"exact accuracy on held-out problems: {before * 100:.1f}% after warm-up -> "
                     f"{after * 100:.1f}% after RL ({(after - before) * 100:+.1f} points) in "
                     f"{summary.wall_seconds:.0f} s")
        for key, first in summary.before.items():  # evaluation sets: avg@k before and after RL
            last = summary.after.get(key)
            if "/avg@" in key and last is not None:
                self.log(f"{key}: {first * 100:.1f}% before RL -> {last * 100:.1f}% after RL "
                         f"({(last - first) * 100:+.1f} points) in {summary.wall_seconds:.0f} s")
        self.log(f"run directory: {self.run_dir}")
