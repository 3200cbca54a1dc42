"""Assemble the roles of one run: model assets, trainer, rollout fleet, weight sync and observability.

`System.start(cfg, run_dir)` brings everything up in order and `close()` tears it down in reverse;
the driver only calls the methods here, so it reads like the step it runs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from miles_lite.config.schema import MilesConfig
from miles_lite.data.gsm8k import MathProblem
from miles_lite.data.prompts import render_prompt
from miles_lite.engines.fleet_launch import attach_fleet, start_fleet
from miles_lite.model_assets import prepare_model
from miles_lite.rewards import get_reward_set, score
from miles_lite.rollout.fleet import EngineFleet
from miles_lite.rollout.manager import RolloutManager
from miles_lite.rollout.prompt_spec import PromptSpec, sampling_from_config
from miles_lite.rollout.sync_api import EventLoopThread, SyncRolloutManager
from miles_lite.types import Group, TrainBatch
from miles_lite.weight_sync.coordinator import SyncReport, WeightSyncCoordinator
from miles_lite.weight_sync.plan import EngineSpec
from miles_lite.weight_sync.transport import EngineLoop, FleetEngine, WeightSyncError


class System:
    """The live roles of a run. Build with `System.start`; always `close()` (or use `with`)."""

    def __init__(self, cfg: MilesConfig, run_dir: Path, tokenizer: Any) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        self.tokenizer = tokenizer
        self.reward_set = get_reward_set(cfg.rewards.set).with_weights(dict(cfg.rewards.weights))
        eos = tokenizer.eos_token_id
        self.stop_token_ids = [eos] if eos is not None else []
        self.sampling = sampling_from_config(cfg.rollout, stop_token_ids=self.stop_token_ids,
                                             seed=cfg.experiment.seed)
        self.trainer: Any = None
        self.loop_thread: EventLoopThread | None = None
        self.fleet: EngineFleet | None = None
        self.rollout_gang: Any = None
        self.rollout: SyncRolloutManager | None = None
        self.sync: WeightSyncCoordinator | None = None
        self.version = 0
        # Step of the newest checkpoint this process saved (None: none yet).
        self.last_checkpoint_step: int | None = None

    # ---- lifecycle ------------------------------------------------------------------------------

    @classmethod
    def start(cls, cfg: MilesConfig, run_dir: Path) -> System:
        """Prepare the model, then start the trainer, the engines and the weight-sync group."""
        cfg, tokenizer = prepare_model(cfg, run_dir)
        system = cls(cfg, run_dir, tokenizer)
        try:
            system._start_trainer()
            system._start_rollout()
            system._start_sync()
        except BaseException:
            system.close()
            raise
        return system

    def _start_trainer(self) -> None:
        world = self.cfg.trainer.tp * self.cfg.trainer.dp * self.cfg.trainer.pp
        if self.cfg.cluster.mode == "ray" or world > 1:
            from miles_lite.cluster.ray_trainer import RayTrainerGroup

            self.trainer = RayTrainerGroup.start(self.cfg)
        else:
            from miles_lite.cluster.local_trainer import LocalTrainer

            self.trainer = LocalTrainer(self.cfg)

    def _start_rollout(self) -> None:
        self.loop_thread = EventLoopThread().start()
        log_dir = str(self.run_dir / "logs")
        rollout, ft = self.cfg.rollout, self.cfg.fault_tolerance
        if rollout.engine_urls:
            # Engines started elsewhere (e.g. operator-managed pods): attach, do not launch.
            self.fleet = self.loop_thread.run(attach_fleet(rollout, ft, list(rollout.engine_urls)))
        elif self.cfg.cluster.mode == "ray":
            # One engine actor per bundle of the rollout gang, each serving from its own node.
            from miles_lite.cluster.engine_gang import RolloutGang, start_gang_fleet
            from miles_lite.cluster.gang import trainer_gang

            self.rollout_gang = RolloutGang.reserve(self.cfg, log_dir, self.trainer.placement_group,
                                                    trainer_gang(self.cfg).bundles)
            self.fleet = self.loop_thread.run(start_gang_fleet(self.rollout_gang))
        else:
            self.fleet = self.loop_thread.run(start_fleet(rollout, ft, str(self.cfg.model.hf_path), log_dir))
        tok = self.tokenizer
        manager = RolloutManager(self.fleet, self.cfg.rollout, self.cfg.fault_tolerance,
                                 decode=lambda ids: tok.decode(ids, skip_special_tokens=True),
                                 stop_token_ids=self.stop_token_ids, seed=self.cfg.experiment.seed)
        self.rollout = SyncRolloutManager(manager, self.loop_thread)

    def _start_sync(self) -> None:
        from miles_lite.weight_sync.factory import build_coordinator

        assert self.loop_thread is not None
        self.sync = build_coordinator(self.cfg, self.trainer, EngineLoop(self.loop_thread.loop), self.run_dir)

    def close(self) -> None:
        """Stop weight sync, the engines and the trainer, in that order; safe to call twice.

        Every role is stopped even when stopping an earlier one fails (engine processes and trainer
        actors must not outlive the run); the first failure is raised afterwards.
        """
        try:
            if self.sync is not None:
                sync, self.sync = self.sync, None
                sync.close()
        finally:
            try:
                if self.fleet is not None and self.loop_thread is not None:
                    fleet, self.fleet = self.fleet, None
                    self.loop_thread.run(fleet.close())
            finally:
                try:
                    try:
                        if self.loop_thread is not None:
                            loop_thread, self.loop_thread = self.loop_thread, None
                            loop_thread.stop()
                    finally:
                        # Engine actors left (a launch cut short) and the rollout gang's reservation.
                        if self.rollout_gang is not None:
                            gang, self.rollout_gang = self.rollout_gang, None
                            gang.close()
                finally:
                    if self.trainer is not None:
                        trainer, self.trainer = self.trainer, None
                        trainer.close()

    def __enter__(self) -> System:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- the calls the driver makes ---------------------------------------------------------------

    def render(self, question: str) -> str:
        return render_prompt(self.tokenizer, question, self.cfg.data.prompt_template)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def prompt_specs(self, batch: Sequence[tuple[int, MathProblem]]) -> list[PromptSpec]:
        specs = []
        for index, p in batch:
            text = self.render(p.question)
            specs.append(PromptSpec(index, tuple(self.encode(text)), text, p.question, p.answer, p.steps))
        return specs

    def score(self, groups: Sequence[Group]) -> list[Group]:
        """Fill every sample's `rewards` (each reward's raw value and the weighted `total`)."""
        samples = [(g, s) for g in groups for s in g.samples]
        scored = score(self.reward_set, [s.response_text for _, s in samples], [g.answer for g, _ in samples],
                       [g.question for g, _ in samples], [g.steps for g, _ in samples])
        for (_, sample), values in zip(samples, scored, strict=True):
            sample.rewards = values
        return list(groups)

    def sft_batch(self, problems: Sequence[MathProblem]) -> TrainBatch:
        """Tokenised (prompt, tag-format reference solution) pairs for the SFT warm-up."""
        from miles_lite.data.prompts import format_solution

        eos = self.tokenizer.eos_token or ""
        tokens, plens = [], []
        for p in problems:
            prompt = self.encode(self.render(p.question))
            target = self.encode(format_solution(p) + eos)
            tokens.append(prompt + target)
            plens.append(len(prompt))
        return TrainBatch.without_rollout(tokens, plens)

    def push_weights(self) -> tuple[SyncReport, float]:
        """Push the trainer's weights as the next version to every engine that serves or waits to.

        An engine that died since its last health check fails the push: the engines of the push are
        then health-checked at once, the dead ones go to the fleet for replacement, and the push is
        made again to the others (once). A failure on live engines (a dropped update, a probe mismatch)
        is raised. Returns the sync report and the wall seconds of the whole push.
        """
        assert self.sync is not None and self.fleet is not None and self.loop_thread is not None
        from miles_lite.rollout.engine_state import EngineState

        start = time.perf_counter()
        self.version += 1
        version = str(self.version)
        fleet = self.fleet

        # The fleet's state belongs to the rollout loop (its transitions wake tasks waiting there):
        # read and change it on that loop, never from this thread.
        async def begin() -> list[Any]:
            records = [r for r in fleet.records if r.state in (EngineState.HEALTHY, EngineState.STALE)]
            fleet.set_current_version(version)
            fleet.begin_weight_update(records)
            return records

        async def finish(synced: Sequence[Any]) -> None:
            fleet.end_weight_update(held, answered=bool(synced))
            for r in synced:
                fleet.mark_synced(r.engine_id, version)

        held = records = self.loop_thread.run(begin())
        try:
            try:
                report = self.sync.push(self._sync_targets(records), self.trainer.weight_shards, version)
            except WeightSyncError:
                dead = self.loop_thread.run(fleet.confirm_dead(records))
                records = [r for r in records if all(r is not d for d in dead)]
                if not dead or not records:
                    raise
                report = self.sync.push(self._sync_targets(records), self.trainer.weight_shards, version)
        except BaseException:
            self.loop_thread.run(finish([]))
            raise
        self.loop_thread.run(finish(records))
        return report, time.perf_counter() - start

    def _sync_targets(self, records: Sequence[Any]) -> list[FleetEngine]:
        """The weight-sync view of fleet `records`: each engine with its id, TP size and vocabulary padding."""
        # Reference engines hold HF shapes (no vocab padding); SGLang pads its vocabulary to 64 rows.
        pad = 1 if self.cfg.rollout.backend == "reference" else 64
        # A replacement keeps its slot's engine id but is a new process: naming the incarnation makes
        # the weight-sync coordinator see a new fleet and rebuild its group with the replacement in it.
        sync_ids = [r.engine_id if r.incarnation == 0 else f"{r.engine_id}.{r.incarnation}" for r in records]
        return [FleetEngine(r.engine, EngineSpec(sid, self.cfg.rollout.engine_tp, pad))
                for r, sid in zip(records, sync_ids, strict=True)]

    def report_fleet_events(self, log: Callable[[str], None]) -> None:
        """Send the fleet's notable events (an engine died, a replacement admitted after push N) to `log`."""
        assert self.fleet is not None
        self.fleet.on_event = log

    def fleet_stats(self) -> dict[str, float]:
        assert self.fleet is not None
        return self.fleet.stats()
