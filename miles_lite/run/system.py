"""Assemble the roles of one run: model assets, trainer, rollout fleet, weight sync; tear them down.

`System.start(cfg, run_dir)` brings everything up in order and `close()` takes it down in reverse. The
work itself lives in the roles: tokenization in `data.encoding.PromptEncoder`, reward scoring in
`rewards`, the weight push (targets, dead-engine retry) in `weight_sync.fleet_push.FleetPusher`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from miles_lite.cluster.role import TrainerRole
from miles_lite.config.colocation import hands_off
from miles_lite.config.lora_serving import serves_adapters, with_lora_serving
from miles_lite.config.schema import MilesConfig
from miles_lite.config.validate import remote_reward_spec
from miles_lite.config.views import EngineFleetConfig, TrainerRoleConfig, WeightSyncSetup
from miles_lite.config.weight_sync_choice import shared_gpus, trainer_on_gpu
from miles_lite.data.encoding import PromptEncoder
from miles_lite.engines.fleet_launch import Rollout, build_rollout
from miles_lite.net.api_key import ApiKey
from miles_lite.plugins import PluginPool
from miles_lite.rewards.setup import build_reward_set
from miles_lite.rollout.fleet import EngineFleet
from miles_lite.rollout.prestarted import PrestartPool
from miles_lite.rollout.prompt_spec import sampling_from_config
from miles_lite.rollout.starvation import StarvationRelay
from miles_lite.rollout.sync_api import EventLoopThread, SyncRolloutManager
from miles_lite.run.model_assets import prepare_model, run_chat_template
from miles_lite.timing import PhaseTimer
from miles_lite.weight_sync.coordinator import SyncReport, WeightSyncCoordinator
from miles_lite.weight_sync.fleet_push import FleetPusher
from miles_lite.weight_sync.transport import EngineLoop, WeightSyncError

logger = logging.getLogger(__name__)


def starts_together(cfg: MilesConfig) -> bool:
    """Whether the engines may start while the trainer does: local engine processes (or engines started
    elsewhere) beside an in-process trainer on CPU, or on GPUs of their own; not where the roles share a
    device (colocated: the trainer's memory goes first) or start through Ray (one reservation after the other)."""
    if cfg.cluster.mode == "ray" or cfg.trainer.world_size > 1 or hands_off(cfg):
        return False
    return not trainer_on_gpu(cfg) or not shared_gpus(cfg)


def start_trainer(cfg: MilesConfig) -> TrainerRole:
    """The trainer role: in this process for world size 1 under `cluster=local`, else a Ray gang."""
    if cfg.cluster.mode == "ray" or cfg.trainer.world_size > 1:
        from miles_lite.cluster.ray_trainer import RayTrainerGroup

        return RayTrainerGroup.start(TrainerRoleConfig.of(cfg))
    from miles_lite.cluster.local_trainer import LocalTrainer

    return LocalTrainer(TrainerRoleConfig.of(cfg))


class System:
    """The live roles of a run. Build with `System.start`; always `close()` (or use `with`)."""

    def __init__(self, cfg: MilesConfig, run_dir: Path, tokenizer: Any, api_key: ApiKey | None = None) -> None:
        self.cfg = cfg
        # The run's key: the engines ask for it, the weight-update group admits only ranks presenting it.
        self.api_key = api_key if api_key is not None else ApiKey.for_run(cfg.cluster.api_key_file)
        self.run_dir = run_dir
        self.tokenizer = tokenizer
        # The agent sessions' chat template, checked on the tokenizer before any engine starts; prompts and SFT
        # trajectories render through it as the gateway renders sessions.
        self.chat_template = run_chat_template(cfg, tokenizer)
        self.encoder = PromptEncoder(tokenizer, cfg.data.prompt_template,
                                     tool_solutions=cfg.rollout.environment == "calculator",
                                     max_prompt_tokens=cfg.data.max_prompt_tokens, chat_template=self.chat_template,
                                     raw_prompts=not cfg.data.chat_template)
        # Blocking plug-in calls (environment replies, reward functions) run here, off the rollout loop.
        self.plugins = PluginPool(cfg.rollout.plugin_workers, cfg.rollout.plugin_pool, cfg.rollout.plugin_timeout_s)
        self.reward_set = build_reward_set(cfg.rewards.set, cfg.rewards.weights, cfg.rewards.custom,
                                           remote_reward_spec(cfg), cfg.rewards.by_source, cfg.rewards.answer_pattern,
                                           agent=cfg.rollout.agent is not None).run_in(self.plugins,
                                                                                        cfg.rewards.timeout_s)
        self.sampling = sampling_from_config(cfg.rollout, stop_token_ids=self.encoder.stop_token_ids,
                                             seed=cfg.experiment.seed)
        self.trainer: TrainerRole | None = None
        self._rollout: Rollout | None = None
        self.rollout_gang: Any = None
        self.sync: WeightSyncCoordinator | None = None
        self.pusher: FleetPusher | None = None
        # Waits on a rollout serve the fleet's requests to push the current weights to stale engines.
        self.relay = StarvationRelay(self.refresh_stale)
        # The version of the weights last pushed: the RL optimizer steps they had taken (docs/observability.md,
        # "Rollout table"); `pushed` turns true at the first push.
        self.version = 0
        self.pushed = False
        # The report of the latest push of the current version to stale engines (`refresh_stale`).
        self.last_refresh: SyncReport | None = None
        # Step of the newest checkpoint this process saved (None: none yet).
        self.last_checkpoint_step: int | None = None
        # Trainer parts offloaded before the engines started (colocated hand-off: they start into the room).
        self.offloaded_at_start: tuple[str, ...] = ()
        # Engine processes started ahead of this run (`start`), taken by the first launch of each engine.
        self.prestarted: PrestartPool | None = None

    # ---- lifecycle ------------------------------------------------------------------------------

    @classmethod
    def start(cls, cfg: MilesConfig, run_dir: Path, prestarted: PrestartPool | None = None) -> System:
        """Prepare the model, then start the trainer, the engines and the weight-sync group. `prestarted`:
        engine processes the command line started ahead (`engines.reference.prestart.prestart_engines`); the engines
        of this run are started in them."""
        api_key = ApiKey.for_run(cfg.cluster.api_key_file)  # a bad key file fails before anything starts
        stages = PhaseTimer()  # each stage's seconds, logged once all started (the run's log)
        try:
            with stages.phase("model"):
                cfg, tokenizer = prepare_model(cfg, run_dir)
            cfg = with_lora_serving(cfg)
            system = cls(cfg, run_dir, tokenizer, api_key)
            system.prestarted = prestarted
        except BaseException:
            api_key.close()
            raise
        try:
            if starts_together(cfg):
                with stages.phase("trainer and engines"):
                    system._start_trainer_and_rollout()
            else:
                with stages.phase("trainer"):
                    system.trainer = start_trainer(cfg)
                if hands_off(cfg):
                    system.offloaded_at_start = cfg.trainer.offload.parts()
                    with stages.phase("trainer offload"):
                        system.trainer.offload(system.offloaded_at_start)
                with stages.phase("engines"):
                    system._rollout = system._start_rollout()
            with stages.phase("weight sync"):
                system._start_sync()
        except BaseException:
            system.close()
            raise
        logger.info("start-up: %s", ", ".join(f"{name} {s:.1f} s" for name, s in stages.seconds.items()))
        return system

    def _start_trainer_and_rollout(self) -> None:
        """Start the engines on a worker thread while the trainer starts here: engine processes import and load
        their model on other cores while this process builds the trainer. Whichever fails, both are kept for
        `close`, and the trainer's failure is raised first."""
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout-start") as pool:
            pending = pool.submit(self._start_rollout)
            trainer_error: BaseException | None = None
            try:
                self.trainer = start_trainer(self.cfg)
            except BaseException as exc:  # noqa: BLE001 - re-raised once the engines' start has ended
                trainer_error = exc
            try:
                self._rollout = pending.result()
            except BaseException:
                if trainer_error is None:
                    raise
            if trainer_error is not None:
                raise trainer_error

    def _start_rollout(self) -> Rollout:
        log_dir = str(self.run_dir / "logs")
        start: Any = None
        if self.cfg.cluster.mode == "ray" and not self.cfg.rollout.engine_urls:
            # One engine actor per bundle of the rollout gang, each serving from its own node.
            from miles_lite.cluster.engine_gang import RolloutGang, start_gang_fleet
            from miles_lite.cluster.gang import trainer_gang

            gang = self.rollout_gang = RolloutGang.reserve(EngineFleetConfig.of(self.cfg), log_dir,
                                                           self.trainer.placement_group,
                                                           trainer_gang(self.cfg.trainer, self.cfg.cluster).bundles)

            def gang_fleet() -> Any:
                return start_gang_fleet(gang, api_key=self.api_key.value)

            start = gang_fleet
        return build_rollout(EngineFleetConfig.of(self.cfg), self.tokenizer, log_dir, seed=self.cfg.experiment.seed,
                             start=start, api_key=self.api_key, plugins=self.plugins, chat_template=self.chat_template,
                             prestarted=self.prestarted if start is None else None)

    def _start_sync(self) -> None:
        from miles_lite.weight_sync.factory import build_coordinator

        assert self.trainer is not None and self.loop_thread is not None and self.fleet is not None
        loop = EngineLoop(self.loop_thread.loop)
        self.sync = build_coordinator(WeightSyncSetup.of(self.cfg), self.trainer, loop, self.run_dir,
                                      self.api_key.value)
        self.pusher = FleetPusher(self.sync, self.fleet, loop, self.cfg.rollout.engine_tp, self.cfg.rollout.backend)
        self.fleet.on_starved = self.relay.signal
        assert self.rollout is not None
        self.rollout.relay = self.relay

    def close(self) -> None:
        """Stop weight sync, the engines and the trainer, in that order; safe to call twice.

        Every role is stopped even when stopping an earlier one fails (engine processes and trainer
        actors must not outlive the run); the first failure is raised afterwards.
        """
        try:
            if self.sync is not None:
                sync, self.sync, self.pusher = self.sync, None, None
                sync.close()
        finally:
            try:
                try:
                    if self._rollout is not None:
                        rollout, self._rollout = self._rollout, None
                        rollout.close()
                finally:
                    # Engine actors left (a launch cut short) and the rollout gang's reservation.
                    if self.rollout_gang is not None:
                        gang, self.rollout_gang = self.rollout_gang, None
                        gang.close()
            finally:
                try:
                    if self.trainer is not None:
                        trainer, self.trainer = self.trainer, None
                        trainer.close()
                finally:
                    self.plugins.close()
                    self.api_key.close()

    def __enter__(self) -> System:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- the roles ----------------------------------------------------------------------------------

    @property
    def loop_thread(self) -> EventLoopThread | None:
        return self._rollout.loop if self._rollout is not None else None

    @property
    def fleet(self) -> EngineFleet | None:
        return self._rollout.fleet if self._rollout is not None else None

    @property
    def rollout(self) -> SyncRolloutManager | None:
        return self._rollout.manager if self._rollout is not None else None

    # ---- the calls the driver makes ---------------------------------------------------------------

    def push_weights(self, version: int, before_wake: Callable[[], None] | None = None) -> tuple[SyncReport, float]:
        """Push the trainer's weights as `version`, the RL optimizer steps they have taken (0 before the first
        step, warm-up included; a re-push of unchanged weights carries the same version): see
        `FleetPusher.push` (and its `before_wake`). The report and the wall seconds of the whole push."""
        assert self.pusher is not None and self.trainer is not None
        if version < 0:
            raise ValueError(f"a weight version counts RL steps; got {version}")
        start = time.perf_counter()
        report = self.pusher.push(self._push_source(), str(version), before_wake=before_wake)
        self.version, self.pushed = version, True
        return report, time.perf_counter() - start

    def _push_source(self) -> Any:
        """What a push carries: the trainer's adapters (LoRA, `weight_sync.lora=adapter|tensors`), else its weight
        shards."""
        assert self.trainer is not None
        return self.trainer.adapter_tensors if serves_adapters(self.cfg) else self.trainer.weight_shards

    def refresh_stale(self) -> SyncReport | None:
        """Push the current version to the stale engines when no engine is healthy (the relay calls this
        on the driver thread while it waits on a rollout, so the trainer holds that version's weights).

        None when there is nothing to do: an engine serves again, or nothing was pushed yet (the trainer's
        weights may then differ from the checkpoint the engines started from; a replacement reporting the
        fleet's version is admitted without a push). A push that fails is logged: the fleet replaces the
        engine and asks again, and the rollout's own timeout bounds the wait.
        """
        assert self.pusher is not None and self.trainer is not None and self.loop_thread is not None
        fleet, version = self.pusher.fleet, str(self.version)

        async def starved() -> bool:
            return fleet.starved() and fleet.current_version == version

        if not self.pushed or not self.loop_thread.run(starved()):
            return None
        # A hand-off run waits on rollouts with the trainer's parameters in host memory (`handoff.py`): the push
        # reads them and the probe scores with them, so they come back for it (if away) and leave again after.
        start = time.perf_counter()
        moved = self.trainer.onload(("params",)) if hands_off(self.cfg) else {}
        try:
            report = self.pusher.push(self._push_source(), version, stale_only=True)
        except WeightSyncError as exc:
            logger.warning("push of version %s to the stale engines failed: %s", version, exc)
            return None
        finally:
            if "params_bytes" in moved:
                self.trainer.offload(("params",))
        self.last_refresh = report
        if fleet.on_event is not None:
            probe = f", probe logp diff mean {report.verify.logp_diff_mean:.2e}" if report.verify else ""
            fleet.on_event(f"fleet: no healthy engine left mid-rollout: pushed the current version {version} to "
                           f"{', '.join(report.push.engines)} in {time.perf_counter() - start:.1f}s{probe}")
        return report

    def report_fleet_events(self, log: Callable[[str], None]) -> None:
        """Send the fleet's notable events (an engine died, a replacement admitted after push N) to `log`."""
        assert self.fleet is not None
        self.fleet.on_event = log

    def fleet_stats(self) -> dict[str, float]:
        assert self.fleet is not None
        return self.fleet.stats()
