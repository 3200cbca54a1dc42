"""The RL loop. Each step reads like the design: prompts -> groups -> rewards -> advantages -> train ->
checkpoint -> weight push -> metrics. Everything else lives in the modules it calls.

On SIGUSR1 or SIGTERM (Slurm's pre-emption warning, `kubectl delete`) the driver finishes the
current step, saves a checkpoint and returns normally, so the process exits 0 and a requeued job
resumes with `checkpoint.resume=auto`.
"""

from __future__ import annotations

import json
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miles_lite.config import MilesConfig, to_yaml
from miles_lite.data.source import PromptSource
from miles_lite.evaluation import EvalResult, evaluate
from miles_lite.rl_batch import build_train_batch, reward_stats, rollout_stats
from miles_lite.run_io import RunIO
from miles_lite.system import System, load_problems
from miles_lite.warmup import presample_filter, run_warmup


class StopRequest:
    """Set by SIGUSR1/SIGTERM; the loop checks it between steps (a step is never cut in half)."""

    def __init__(self) -> None:
        self.signal: int | None = None
        self._previous: dict[int, Any] = {}

    def install(self) -> StopRequest:
        for sig in (signal.SIGUSR1, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        self.signal = signum
        print(f"miles-lite: received {signal.Signals(signum).name}; stopping after this step with a checkpoint",
              flush=True)

    @property
    def requested(self) -> bool:
        return self.signal is not None

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


@dataclass
class RunSummary:
    """What a finished run reports (also written to `summary.json`)."""

    run_dir: str
    steps_done: int
    wall_seconds: float
    before: dict[str, float] = field(default_factory=dict)
    after: dict[str, float] = field(default_factory=dict)
    stopped_by_signal: bool = False


def run_name(cfg: MilesConfig) -> str:
    return cfg.experiment.run_name or f"{cfg.experiment.name}-{time.strftime('%Y%m%d-%H%M%S')}"


def train(cfg: MilesConfig) -> RunSummary:
    """Run RL training end to end as configured; returns the run's summary."""
    start = time.perf_counter()
    run_dir = Path(cfg.experiment.output_dir) / run_name(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    stop = StopRequest().install()
    train_problems, held_out = load_problems(cfg)
    data = PromptSource(train_problems, seed=cfg.data.shuffle_seed)
    try:
        with System.start(cfg, run_dir) as system, RunIO(system.cfg, run_dir, run_name(cfg)) as io:
            first_step = io.resume(system, data)
            summary = RunSummary(str(run_dir), first_step, 0.0)
            if first_step == 0:
                run_warmup(system, train_problems, io)
                io.report_sync(*system.push_weights())
                summary.before = io.report_eval("after warm-up", eval_now(system, held_out))
                presample_filter(system, data, train_problems, io)
            for step in range(first_step, cfg.experiment.steps):
                rl_step(system, data, io, step)
                summary.steps_done = step + 1
                if stop.requested:
                    summary.stopped_by_signal = True
                    break
            io.save_checkpoint(system, data, summary.steps_done, final=True)
            if not summary.stopped_by_signal:
                summary.after = io.report_eval("after RL", eval_now(system, held_out))
            summary.wall_seconds = time.perf_counter() - start
            io.finish(summary)
    finally:
        stop.restore()
    return summary


def eval_now(system: System, held_out: list) -> EvalResult:
    assert system.rollout is not None
    return evaluate(system.rollout, held_out, system.render, system.encode, system.sampling)


def rl_step(system: System, data: PromptSource, io: RunIO, step: int) -> None:
    """One RL step on the current weights."""
    cfg = system.cfg
    assert system.rollout is not None
    timer = io.timer()
    with timer.phase("generate"):
        prompts = system.prompt_specs(data.next_batch(cfg.rollout.prompts_per_step))
        groups = system.rollout.generate_groups(prompts, cfg.rollout.group_size)
    with timer.phase("reward"):
        groups = system.score(groups)
    batch, algo_stats = build_train_batch(groups, cfg.algo)
    train_stats: dict[str, float] = {}
    if batch is not None:
        with timer.phase("train"):
            train_stats = system.trainer.train_step(batch)
    with timer.phase("checkpoint"):
        io.maybe_save_checkpoint(system, data, step + 1)
    with timer.phase("sync"):
        sync_report, sync_seconds = system.push_weights()
    io.report_sync(sync_report, sync_seconds)
    stats: dict[str, Any] = {**reward_stats(groups), **algo_stats, **train_stats, **timer.stats(),
                             **rollout_stats(system.rollout.last_stats), "weight_version": system.version}
    io.publish_step(step, stats, groups, system.fleet_stats())


def load_summary(run_dir: str | Path) -> dict[str, Any]:
    """The `summary.json` a finished run wrote."""
    return json.loads((Path(run_dir) / "summary.json").read_text())
