"""The RL loop. Each step reads like the design: prompts -> groups -> rewards -> advantages -> train ->
checkpoint -> weight push -> metrics. Everything else lives in the modules it calls.

Rollouts go through a `RolloutPipeline` (the manager's calls run on the rollout event-loop thread):

- `rollout.async_steps=0`: each step generates its groups on the weights the trainer has now.
- `rollout.async_steps=N` (N >= 1, N-step-off): right after step S's groups are collected, the batches
  of steps S+1 .. S+N are started (those not started yet); the pipeline generates them in order while
  the trainer trains step S. Before the push that follows step S the pipeline pauses: batches already
  done are simply kept; a running one is aborted at a token boundary, its complete groups kept and its
  unfinished completions resumed on the new weights after the push (the manager tags them with both
  versions, e.g. "3+4"). Step S+k therefore trains on groups up to k versions old. Groups whose oldest
  token is more than `rollout.max_staleness` versions behind the trainer are dropped and counted
  (`rollout/stale_dropped`, next to `rollout/mixed_version_samples`, `rollout/staleness_*` and the
  per-lag sample counts `rollout/staleness_samples/<lag>`); the trainer's importance weights
  (`algo.is_*`) correct the rest against the log-probs of the weights that sampled them. A checkpoint
  records the prompt cursor from before the oldest in-flight batch's prompts, so a resumed run draws
  them again.

On SIGUSR1 or SIGTERM (Slurm's pre-emption warning, `kubectl delete`) the driver finishes the
current step, saves a checkpoint and returns normally, so the process exits 0 and a requeued job
resumes with `checkpoint.resume=auto`.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miles_lite.checkpoint.driver_state import DriverState, restore_driver_rng
from miles_lite.checkpoint.resume import newest_complete, resolve_resume, set_aside_newer
from miles_lite.config import MilesConfig, to_yaml
from miles_lite.config.changes import config_tree
from miles_lite.config.weight_sync_choice import trainer_on_gpu
from miles_lite.data.identity import data_identity
from miles_lite.data.problems import EvalSet, load_eval_sets, load_problems
from miles_lite.data.source import PromptSource
from miles_lite.evaluation.greedy import EvalResult, evaluate
from miles_lite.evaluation.sets import SetResult, evaluate_set
from miles_lite.net import startup_heap
from miles_lite.observability.run_log import RunLog
from miles_lite.plugins import PluginFailed
from miles_lite.rollout.pipeline import RolloutPipeline
from miles_lite.rollout.prestarted import PrestartPool
from miles_lite.run.dir_probe import OutputDirError, probe_run_dirs
from miles_lite.run.failure import end_on_plugin_failure
from miles_lite.run.handoff import Handoff
from miles_lite.run.lock import RunLock
from miles_lite.run.naming import choose_run, mark_finished, mark_unfinished, named
from miles_lite.run.node_loss import NodeWatch, end_on_node_loss
from miles_lite.run.outputs import RunIO, checkpoint_root, finished_summary
from miles_lite.run.prompt_check import check_prompts_fit
from miles_lite.run.record import ResumePlan, ResumeRefused, plan_resume, record_start_config
from miles_lite.run.reward_log import RewardLog
from miles_lite.run.rl_batch import (
    build_train_batch,
    drop_stale,
    require_scored,
    reward_stats,
    rl_distill_coef,
    rollout_stats,
    tool_stats,
)
from miles_lite.run.stop import RunAborted, StopRequest
from miles_lite.run.system import System
from miles_lite.run.task_check import check_task
from miles_lite.run.warmup import presample_filter, run_warmup
from miles_lite.trainer.guard import TrainingHalted


@dataclass
class RunSummary:
    """What a finished run reports (also written to `summary.json`)."""

    run_dir: str
    steps_done: int
    wall_seconds: float
    before: dict[str, float] = field(default_factory=dict)
    after: dict[str, float] = field(default_factory=dict)
    stopped_by_signal: bool = False
    # Why the run ended before `experiment.steps` (the signal, the guard that halted training, a plug-in).
    stopped_reason: str | None = None
    # A resume's changes of the configuration (`record.ResumePlan.as_json`); None: a fresh start.
    config_changes: dict[str, Any] | None = None
    # The plug-in that ended the run: plugin, where, error, log, resume_from.
    plugin_failure: dict[str, Any] | None = None
    # The Ray nodes whose loss ended the run: nodes, step, error, log, resume_from.
    node_loss: dict[str, Any] | None = None


def run_name(cfg: MilesConfig) -> str:
    """The run's name: `experiment.run_name` once `train` has chosen it (`run.naming`)."""
    return cfg.experiment.run_name or choose_run(cfg).name


def train(cfg: MilesConfig, stop: StopRequest | None = None, prestarted: PrestartPool | None = None) -> RunSummary:
    """Run RL training end to end as configured; returns the run's summary.

    `stop`: an installed `StopRequest` (the CLI installs it before the heavy imports, so an early
    pre-emption signal is not lost); None installs one here. A second Ctrl-C raises `RunAborted` once the
    roles are stopped. `prestarted`: engine processes the CLI started ahead for this run's engines (the caller
    closes the pool: what the run did not take ends then).
    """
    start = time.perf_counter()
    choice = choose_run(cfg)  # an unfinished run of the same settings is continued (`run.naming`)
    cfg = named(cfg, choice)
    run_dir = Path(cfg.experiment.output_dir) / choice.name
    stop = stop or StopRequest().install()
    locks: list[RunLock] = []
    try:
        # A data error ends the run before it has a directory.
        notes: list[str] = []
        train_problems, held_out = load_problems(cfg.data, cfg.experiment.eval_size, notes)
        eval_sets = load_eval_sets(cfg.data, cfg.experiment.eval_size)
        check_task(cfg, train_problems, eval_sets)
        check_prompts_fit(cfg, train_problems, held_out, eval_sets)
        notes += [f"evaluation set {s.name!r}: {s.cut} (its size, or experiment.eval_size for held_out)"
                  for s in eval_sets if s.cut]
        done = finished_summary(cfg, run_dir)  # reads only: a finished run re-run writes nothing
        if done is not None:
            mark_finished(choice)
            print(f"miles-lite: {run_dir} already finished {done['steps_done']} steps (experiment.steps="
                  f"{cfg.experiment.steps}); nothing to do. Raise experiment.steps to train further.", flush=True)
            return RunSummary(**{k: v for k, v in done.items() if k in RunSummary.__dataclass_fields__})
        for note in [choice.note, *notes] if choice.note else notes:
            print(f"miles-lite: {note}", flush=True)
        new_dir = not run_dir.exists()
        try:
            locks.append(RunLock(run_dir))
            probe_run_dirs(cfg, run_dir, checkpoint_root(cfg, run_dir))
        except (OSError, OutputDirError) as err:
            for lock in locks:
                lock.release(remove_file=new_dir)
            locks.clear()
            if new_dir and run_dir.is_dir() and not any(run_dir.iterdir()):
                run_dir.rmdir()
            if isinstance(err, OutputDirError):
                raise
            raise OutputDirError(f"experiment.output_dir={cfg.experiment.output_dir!r}: cannot create the run "
                                 f"directory {run_dir} ({err.strerror or err}); set experiment.output_dir to a "
                                 "writable directory") from None
        if cfg.checkpoint.dir and not Path(cfg.checkpoint.dir).resolve().is_relative_to(run_dir.resolve()):
            locks.append(RunLock(cfg.checkpoint.dir, "checkpoint.dir"))
        mark_unfinished(choice)
        try:
            summary = _train(cfg, run_dir, stop, train_problems, held_out, start, eval_sets, prestarted)
        except KeyboardInterrupt:  # a second Ctrl-C; the roles were stopped on the way out
            raise RunAborted(run_dir, newest_complete(checkpoint_root(cfg, run_dir))) from None
        if summary.steps_done >= cfg.experiment.steps and summary.stopped_reason is None:
            mark_finished(choice)
        return summary
    finally:
        for lock in reversed(locks):
            lock.release()
        stop.restore()


def _train(cfg: MilesConfig, run_dir: Path, stop: StopRequest, train_problems: list, held_out: list,
           start: float, eval_sets: list[EvalSet] | None = None, prestarted: PrestartPool | None = None) -> RunSummary:
    # Recorded by every checkpoint; compared with what a resume asks for before any work.
    record = {"config": config_tree(cfg), "data": data_identity(cfg.data)}
    recorded_cfg, cfg = cfg, checkpoints_under(cfg, run_dir)
    try:
        chosen = resolve_resume(cfg.checkpoint, log=print)
    except FileNotFoundError as err:  # a path holding no intact checkpoint
        raise ResumeRefused(str(err)) from None
    plan = plan_resume(recorded_cfg, chosen)  # ResumeRefused: nothing touched
    if plan.checkpoint is None and cfg.checkpoint.dir and Path(cfg.checkpoint.dir).is_dir():
        # A fresh start: earlier checkpoints of this run (resume=none, or none intact) belong to another
        # configuration; a later resume must not take them.
        moved = set_aside_newer(cfg.checkpoint.dir, -1, log=lambda _: None)
        if moved:
            print(f"starting from step 0 (checkpoint.resume={cfg.checkpoint.resume}): the run's earlier checkpoints "
                  f"{', '.join(p.name for p in moved)} were moved to {moved[0].parent}", flush=True)
    record_start_config(run_dir, to_yaml(recorded_cfg), plan.step)
    data = PromptSource(train_problems, seed=cfg.data.shuffle_seed)
    with RunLog(run_dir), System.start(cfg, run_dir, prestarted) as system, \
            RunIO(system.cfg, run_dir, run_name(cfg), record) as io:
        summary = RunSummary(str(run_dir), 0, 0.0, config_changes=plan.as_json() if plan.checkpoint else None)
        nodes = NodeWatch.capture(cfg.cluster) if cfg.cluster.mode == "ray" else None
        try:
            _run(system, io, data, plan, stop, train_problems, held_out, summary, start, eval_sets)
        except PluginFailed as failure:
            raise end_on_plugin_failure(system, io, summary, failure, start) from failure
        except Exception as err:
            lost = nodes.lost() if nodes is not None else []
            if not lost:
                raise
            raise end_on_node_loss(system, io, summary, err, lost, start) from err
    return summary


def _run(system: System, io: RunIO, data: PromptSource, plan: ResumePlan, stop: StopRequest, train_problems: list,
         held_out: list, summary: RunSummary, start: float, eval_sets: list[EvalSet] | None) -> None:
    cfg = system.cfg
    # The roles are up: collections resume (when the entry point paused them). A GPU run first frees the start-up
    # garbage (it could hold device memory); a CPU run's is small and its start-up seconds count.
    startup_heap.settle(collect=trainer_on_gpu(cfg))
    system.report_fleet_events(io.log)
    handoff = Handoff(system)
    handoff.for_training()  # a resume loads the trainer's whole state; a fresh run's warm-up trains
    driver = io.resume(system, plan.checkpoint)
    first_step = continue_from(driver, system, data, io, handoff, plan.data_changed)
    summary.steps_done = first_step
    rewards = RewardLog(cfg, data)
    if driver is not None:  # the evaluations before RL stay the run's baseline
        summary.before = io.before = earlier_before(driver, io.run_dir)
    if (line := plan.line()) is not None:
        io.log(line)
    try:
        ready = first_step > 0 or prepare_rl(system, data, train_problems, held_out, io, stop, summary,
                                               handoff, eval_sets, rewards)
    except PluginFailed as failure:
        failure.where = "before the first RL step (warm-up, evaluation, presample)"
        raise
    if not ready:
        # A checkpoint at step 0 would be resumed as a fresh run, warm-up included, on warmed weights.
        summary.stopped_by_signal = True
        summary.stopped_reason = f"{stop.name} before the first RL step"
        io.log(f"stopped by {stop.name} before the first RL step: no checkpoint written; the next start "
               "begins with the warm-up again")
        summary.wall_seconds = time.perf_counter() - start
        io.finish(summary)
        return
    rollouts = RolloutPipeline(system.rollout.manager, system.loop_thread, cfg.rollout.group_size,
                               relay=system.relay, **refill_hooks(system, data, rewards))
    try:
        for step in range(first_step + 1, cfg.experiment.steps + 1):
            rl_step(system, data, io, rollouts, step, held_out, eval_sets, handoff, rewards,
                    go_on=lambda: not stop.requested)
            summary.steps_done = step
            if stop.requested:
                summary.stopped_by_signal = True
                summary.stopped_reason = stop.name
                break
    except TrainingHalted as halt:
        # The trainer refused the step and kept the last good weights: save those, say why, end.
        summary.stopped_reason = str(halt)
        io.log(f"training stopped: {halt}")
    except PluginFailed as failure:
        failure.where = f"at step {summary.steps_done + 1}/{cfg.experiment.steps}"
        raise
    finally:
        untrained = rollouts.close()
        if untrained is not None:  # the next step's prompts go back to the stream
            data.load_state_dict(untrained)
    handoff.for_training()  # the checkpoint reads the trainer's whole state
    io.save_checkpoint(system, data, summary.steps_done, final=True)
    if summary.stopped_by_signal:
        io.log(f"stopped by {stop.name} after step {summary.steps_done}/{cfg.experiment.steps}: the run continues "
               f"from checkpoint step {summary.steps_done} when started again")
    if handoff.enabled and (held_out or eval_sets) and summary.stopped_reason is None:
        # The engines sleep since the checkpoint: wake them with the same weights (the same version).
        io.report_sync(*handoff.push(summary.steps_done))
    if held_out and summary.stopped_reason is None:
        try:
            summary.after = io.report_eval("after RL", eval_now(system, held_out))
        except PluginFailed as failure:
            failure.where = "in the held-out evaluation after RL"
            raise
    if eval_sets and summary.stopped_reason is None:
        try:
            rewards.steps_done = summary.steps_done
            summary.after.update(io.report_eval_sets("after RL", eval_sets_now(system, eval_sets, rewards),
                                                     summary.steps_done))
        except PluginFailed as failure:
            failure.where = "in the evaluation sets after RL"
            raise
    summary.wall_seconds = time.perf_counter() - start
    io.finish(summary)


def prepare_rl(system: System, data: PromptSource, train_problems: list, held_out: list, io: RunIO,
               stop: StopRequest, summary: RunSummary, handoff: Handoff,
               eval_sets: list[EvalSet] | None = None, rewards: RewardLog | None = None) -> bool:
    """Warm-up, first push, evaluation and presample filter; False when a stop signal cut them short."""
    if stop.requested:
        return False
    if not run_warmup(system, train_problems, io, lambda: stop.requested, data):
        return False
    io.report_sync(*handoff.push(0))  # the weights RL starts from: version 0
    if held_out and not stop.requested:  # experiment.eval_size=0 skips evaluation
        summary.before = io.report_eval("after warm-up", eval_now(system, held_out))
    if eval_sets and not stop.requested:
        summary.before.update(io.report_eval_sets("before RL", eval_sets_now(system, eval_sets, rewards), 0))
    io.before = summary.before  # every checkpoint carries it: a resumed run still compares with it
    if stop.requested:
        return False
    presample_filter(system, data, train_problems, io, rewards.context("presample") if rewards else None)
    return not stop.requested


def checkpoints_under(cfg: MilesConfig, run_dir: Path) -> MilesConfig:
    """Checkpoints live with the run unless `checkpoint.dir` names a shared directory."""
    if cfg.checkpoint.dir is not None:
        return cfg
    checkpoint = dataclasses.replace(cfg.checkpoint, dir=str(checkpoint_root(cfg, run_dir)))
    return dataclasses.replace(cfg, checkpoint=checkpoint)


def continue_from(driver: DriverState | None, system: System, data: PromptSource, io: RunIO,
                  handoff: Handoff, new_data: bool = False) -> int:
    """The step to start from: 0 for a fresh run, else the restored one, with the data cursor, the driver's
    RNG streams and the weight version put back and the restored weights pushed to the engines (they
    started from the initial model). `new_data` (`checkpoint.allow_data_change` on other data): the cursor
    starts at the beginning of the new data instead."""
    if driver is None:
        return 0
    if not new_data:
        data.load_state_dict(driver.data)
    restore_driver_rng(driver.rng)
    # The restored weights have taken `driver.step` RL steps: the version they had when saved.
    io.report_sync(*handoff.push(driver.step))
    return driver.step


def earlier_before(driver: DriverState, run_dir: Path) -> dict[str, float]:
    """The evaluations before RL of a resumed run: from its checkpoint, else (checkpoints that predate
    recording them) from the `summary.json` an earlier start of the run wrote."""
    before = driver.extra.get("before")
    if isinstance(before, dict):
        return dict(before)
    try:
        before = json.loads((run_dir / "summary.json").read_text()).get("before")
    except (OSError, ValueError, AttributeError):
        return {}
    return dict(before) if isinstance(before, dict) else {}


def eval_now(system: System, held_out: list) -> EvalResult:
    assert system.rollout is not None
    return evaluate(system.rollout, held_out, system.encoder.render, system.encoder.encode, system.sampling)


def eval_sets_now(system: System, eval_sets: list[EvalSet], rewards: RewardLog | None = None) -> list[SetResult]:
    """Every evaluation set on the engines' current weights, scored by the run's reward set (its plug-ins see
    the trainer state of `rewards`, at step 0 without it)."""
    assert system.rollout is not None
    context = rewards.context("eval") if rewards is not None else None
    return [evaluate_set(system.rollout, s, system.encoder, system.sampling, system.reward_set, context)
            for s in eval_sets]


@dataclass(frozen=True)
class CursorAt:
    """A prompt-stream position to checkpoint (what `PromptSource.state_dict` returned then)."""

    state: dict[str, Any]

    def state_dict(self) -> dict[str, Any]:
        return self.state


def start_rollouts(system: System, data: PromptSource, rollouts: RolloutPipeline) -> None:
    """Draw the next step's prompts and start generating them; the pipeline keeps the cursor from before."""
    cursor = data.state_dict()
    rollouts.start(system.encoder.prompt_specs(data.next_batch(system.cfg.rollout.prompts_per_step)), tag=cursor)


def refill_hooks(system: System, data: PromptSource, rewards: RewardLog | None = None) -> dict[str, Any]:
    """With `rollout.dynamic_sampling` (DAPO): groups are scored as they complete, and zero-signal ones are
    replaced by groups of fresh prompts from the stream (drawn on the rollout thread; `PromptSource` is
    thread-safe)."""
    if not system.cfg.rollout.dynamic_sampling:
        return {}
    rewards = rewards or RewardLog(system.cfg, data)
    return {"scorer": lambda groups: rewards.score(system.reward_set, groups),
            "more_prompts": lambda n: system.encoder.prompt_specs(data.next_batch(n))}


def starts_next_now(cfg: MilesConfig, step: int, handoff: Handoff, evaluates: bool) -> bool:
    """Whether synchronous rollouts start the next step's generation right after step `step`'s push: not after
    the last step, not before an evaluation (it runs with no generation in flight), not where the roles hand
    the device over (the next step wakes the engines first)."""
    return (cfg.rollout.async_steps == 0 and step < cfg.experiment.steps and not handoff.enabled
            and not (evaluates and eval_due(cfg, step + 1)))


def eval_due(cfg: MilesConfig, step: int) -> bool:
    """Whether step `step` (counted from 1) starts with a held-out evaluation: every `experiment.eval_every`
    steps done (after step 1 at the earliest: the one before RL is `prepare_rl`'s)."""
    every, done = cfg.experiment.eval_every, step - 1
    return every > 0 and done > 0 and done % every == 0


def rl_step(system: System, data: PromptSource, io: RunIO, rollouts: RolloutPipeline, step: int,
            held_out: list | None = None, eval_sets: list[EvalSet] | None = None,
            handoff: Handoff | None = None, rewards: RewardLog | None = None,
            go_on: Callable[[], bool] | None = None) -> None:
    """RL step `step` (counted from 1: the checkpoint after it is `step_<step>`, its push version `step`); with
    `rollout.async_steps=N` the next N steps' generation overlaps its training.

    When `eval_due`, the held-out problems are evaluated (greedy) on the weights of the `step - 1` steps
    done so far, between collecting this step's groups and starting the next generation (no generation
    is in flight then: validation keeps `rollout.async_steps <= 1` with `experiment.eval_every`), and the
    shares join this step's stats as `eval/<measure>`; so do the evaluation sets' measures, as
    `eval/<set>/<measure>`.
    """
    cfg = system.cfg
    timer = io.timer()
    handoff = handoff or Handoff(system)
    rewards = rewards or RewardLog(cfg, data)
    rewards.steps_done = step - 1
    with timer.phase("sync"):
        handoff.for_generation()
    with timer.phase("generate"):
        if not rollouts.busy:
            start_rollouts(system, data, rollouts)
        rollout = rollouts.collect()
    eval_stats: dict[str, float] = {}
    if held_out and eval_due(cfg, step) and not rollouts.busy:
        with timer.phase("eval"):
            result = eval_now(system, held_out)
        io.log(result.table(f"held-out evaluation after {step - 1} RL steps"))
        eval_stats = {f"eval/{k}": v for k, v in result.as_dict().items() if k != "n"}
    if eval_sets and eval_due(cfg, step) and not rollouts.busy:
        with timer.phase("eval"):
            results = eval_sets_now(system, eval_sets, rewards)
        eval_stats.update(io.report_eval_sets(f"evaluation after {step - 1} RL steps", results, step, in_step=True))
    while rollouts.pending < cfg.rollout.async_steps and step + rollouts.pending < cfg.experiment.steps:
        start_rollouts(system, data, rollouts)
    handoff.measure("generate")
    handoff.sleep_engines()  # they go to sleep while the groups are scored and the batch is built
    with timer.phase("reward"):  # dynamic sampling scored the groups as they completed
        groups = rollout.groups if cfg.rollout.dynamic_sampling else rewards.score(system.reward_set, rollout.groups)
    require_scored(groups)
    fresh, stale_stats = drop_stale(groups, system.version, cfg.rollout.max_staleness)
    batch, algo_stats = build_train_batch(fresh, cfg.algo)
    with timer.phase("sync"):
        handoff.for_training()
    train_stats: dict[str, float] = {}
    if batch is not None:
        with timer.phase("train"):
            train_stats = system.trainer.train_step(batch, distill_coef=rl_distill_coef(cfg))
    with timer.phase("sync"):
        # Its offload's host copies are what a checkpoint saved now writes.
        handoff.prepare_push(step, saving=io.checkpoint_due(step))
    with timer.phase("checkpoint"):
        in_flight = rollouts.tag
        io.maybe_save_checkpoint(system, CursorAt(in_flight) if in_flight is not None else data, step)
    handoff.measure("train")
    io.start_rollout_table(step, groups)
    with timer.phase("sync"):
        rollouts.pause()
        sync_report, sync_seconds = handoff.push(step)
        rollouts.resume()
    handoff.measure("sync")
    io.report_sync(sync_report, sync_seconds)
    if go_on is not None and starts_next_now(cfg, step, handoff, bool(held_out or eval_sets)) and go_on():
        # Synchronous rollouts: the next step's prompts generate on the weights just pushed while this step's
        # metrics and rollout table are written (what the next step would do first, done now).
        start_rollouts(system, data, rollouts)
    tools = tool_stats(groups) if cfg.rollout.environment else {}
    stats: dict[str, Any] = {**reward_stats(groups, system.reward_set), **tools, **algo_stats, **train_stats,
                             **timer.stats(),
                             **handoff.stats(),
                             **rollout_stats(rollout.stats), **stale_stats, **eval_stats,
                             "rollout/pauses": float(rollout.pauses),
                             "rollout/groups_short": float(max(0, cfg.rollout.prompts_per_step - len(groups))),
                             "weight_version": system.version, **rewards.drain()}
    io.publish_step(step, stats, groups, system.fleet_stats())


def load_summary(run_dir: str | Path) -> dict[str, Any]:
    """The `summary.json` a finished run wrote."""
    return json.loads((Path(run_dir) / "summary.json").read_text())
