"""The run's side of TRL's reward keywords: the `trainer_state` its reward plug-ins see, and the metrics they
log with `log_metric`, gathered until the step that reports them (as `log_metric/<name>`, their mean)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from miles_lite.config.schema import MilesConfig
from miles_lite.data.source import PromptSource
from miles_lite.rewards import RewardSet, score_groups
from miles_lite.rewards.context import RewardContext, TrainerState
from miles_lite.types import Group

METRIC_PREFIX = "log_metric/"


class RewardLog:
    """Scores groups with a context that knows the run's progress, and keeps what the plug-ins logged.

    Thread-safe: with dynamic sampling the rollout thread scores groups while the driver drains the
    metrics of the step before."""

    def __init__(self, cfg: MilesConfig, data: PromptSource | None = None) -> None:
        self.max_steps = cfg.experiment.steps
        self.eval_steps = cfg.experiment.eval_every
        self.save_steps = cfg.checkpoint.interval
        self.batch_size = cfg.rollout.prompts_per_step * cfg.rollout.group_size
        self.data = data
        # RL steps finished: set by the loop at the start of each step.
        self.steps_done = 0
        self._tokens = 0
        self._lock = threading.Lock()
        self._pending: dict[str, list[float]] = {}

    def trainer_state(self) -> TrainerState:
        """What `trainer_state` holds now."""
        return TrainerState(epoch=self.data.epochs_done() if self.data is not None else 0.0,
                            global_step=self.steps_done, max_steps=self.max_steps, eval_steps=self.eval_steps,
                            save_steps=self.save_steps, train_batch_size=self.batch_size,
                            num_input_tokens_seen=self._tokens)

    def context(self, phase: str = "train") -> RewardContext:
        return RewardContext(self.trainer_state(), phase)

    def score(self, reward_set: RewardSet, groups: Sequence[Group]) -> list[Group]:
        """`score_groups` for training: the plug-ins' metrics wait for `drain`."""
        context = self.context("train")
        scored = score_groups(reward_set, groups, context)
        with self._lock:
            self._tokens += sum(len(s.prompt_ids) + len(s.response_ids) for g in groups for s in g.samples)
            for name, values in context.metrics.items():
                self._pending.setdefault(name, []).extend(values)
        return scored

    def drain(self) -> dict[str, Any]:
        """The mean of every metric logged since the last drain, as `log_metric/<name>`."""
        with self._lock:
            pending, self._pending = self._pending, {}
        return {f"{METRIC_PREFIX}{name}": sum(values) / len(values) for name, values in pending.items() if values}
