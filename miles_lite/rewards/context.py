"""What a reward plug-in in TRL's convention gets besides the batch: `trainer_state`, `log_metric` and `log_extra`.

TRL's GRPOTrainer passes its `transformers.TrainerState` as `trainer_state`, `log_metric(name, value)` (a
scalar averaged over the logging step) and `log_extra(column, values)` (one value per completion, a column of
the completions table). A run hands its plug-ins the same three: a :class:`TrainerState` with the fields of
transformers' class (those the run knows filled in), and loggers whose values land in the step's metrics
(`metrics.jsonl`, under the name given) and in the rollout table (`extra` column).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class TrainerState:
    """The fields of `transformers.TrainerState`, as a run knows them when it scores a batch.

    `global_step`: RL steps finished before the batch's step (TRL scores a step's completions before its
    optimizer step); `max_steps`: `experiment.steps`; `epoch`: passes over the training prompts so far
    (fractional); `train_batch_size`: completions per step; `eval_steps` / `save_steps`: the evaluation and
    checkpoint intervals. Reward functions usually read `global_step` and `max_steps` (a schedule).
    """

    epoch: float = 0.0
    global_step: int = 0
    max_steps: int = 0
    logging_steps: int = 1
    eval_steps: int = 0
    save_steps: int = 0
    train_batch_size: int | None = None
    num_train_epochs: int = 0
    num_input_tokens_seen: int = 0
    total_flos: float = 0.0
    log_history: list[dict[str, float]] = field(default_factory=list)
    best_metric: float | None = None
    best_global_step: int | None = None
    best_model_checkpoint: str | None = None
    is_local_process_zero: bool = True
    is_world_process_zero: bool = True
    is_hyper_param_search: bool = False
    trial_name: str | None = None
    trial_params: dict[str, Any] | None = None
    stateful_callbacks: list[Any] | None = None


class RewardContext:
    """One scoring pass (a step's batch, an evaluation, a presample group): the trainer state its plug-ins
    see and what they logged. `metrics[name]` holds every value `log_metric` got (the step reports their
    mean); `extras[column][row]` the value `log_extra` gave completion `row` of the scored batch."""

    def __init__(self, trainer_state: TrainerState | None = None, phase: str = "train") -> None:
        self.trainer_state = trainer_state if trainer_state is not None else TrainerState()
        self.phase = phase
        self.metrics: dict[str, list[float]] = {}
        self.extras: dict[str, dict[int, Any]] = {}

    def log_metric(self, name: str, value: float) -> None:
        """TRL's `log_metric`: a scalar for this batch (averaged with the step's other values of `name`)."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"log_metric: the name must be a non-empty string, got {name!r}")
        number = float(value)
        if not math.isfinite(number):
            raise ValueError(f"log_metric({name!r}, {value!r}): the value must be a finite number")
        self.metrics.setdefault(name, []).append(number)

    def extra_logger(self, rows: Sequence[int]) -> Callable[[str, list], None]:
        """TRL's `log_extra` for a call that scores the batch rows `rows` (all of them, or one data source's)."""
        rows = list(rows)

        def log_extra(column: str, values: list) -> None:
            if not isinstance(column, str) or not column:
                raise ValueError(f"log_extra: the column must be a non-empty string, got {column!r}")
            values = list(values)
            if len(values) != len(rows):
                raise ValueError(f"log_extra({column!r}, ...) got {len(values)} values for the {len(rows)} "
                                 "completions the reward function was called with (one value per completion)")
            self.extras.setdefault(column, {}).update(zip(rows, values, strict=True))

        return log_extra

    def for_batch(self) -> RewardContext:
        """A context for one more batch of this pass: the same trainer state and metrics, its own extras
        (their rows are positions in that batch)."""
        child = RewardContext(self.trainer_state, self.phase)
        child.metrics = self.metrics
        return child

    def metric_means(self) -> dict[str, float]:
        """Each logged metric's mean over this pass."""
        return {name: sum(values) / len(values) for name, values in self.metrics.items() if values}
