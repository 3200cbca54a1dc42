"""Before any work: do the run's rewards fit its data? A source with no `rewards.by_source` function, a
plug-in asking for a column the records lack, a reward that compares with labels facing a record without one,
a math reward facing a label that is not a number, or chat messages with `data.chat_template=false` stops
the run with the record and the fix named (exit 2, no run directory)."""

from __future__ import annotations

import inspect
import math
from collections.abc import Sequence
from typing import Any

from miles_lite.config.schema import MilesConfig
from miles_lite.config.validate import remote_reward_spec
from miles_lite.data.gsm8k import DatasetError
from miles_lite.data.problems import EvalSet
from miles_lite.rewards import RewardSet
from miles_lite.rewards.batch import columns_problem
from miles_lite.rewards.records import ExactMatch, math_answer
from miles_lite.rewards.registry import RegisteredReward
from miles_lite.rewards.setup import build_reward_set


def run_reward_set(cfg: MilesConfig) -> RewardSet:
    """The reward set `rewards.*` describes (what `System` scores with)."""
    return build_reward_set(cfg.rewards.set, cfg.rewards.weights, cfg.rewards.custom, remote_reward_spec(cfg),
                            cfg.rewards.by_source, cfg.rewards.answer_pattern, agent=cfg.rollout.agent is not None)


def needs_label(reward: RegisteredReward) -> bool:
    """Whether a reward compares completions with the record's label: the math rewards (`answers`) and the
    built-in record rewards (`exact_match`, `math_answer`); plug-ins name the columns they read."""
    return reward.style == "math" or isinstance(reward.fn, ExactMatch) or reward.fn is math_answer


def check_task(cfg: MilesConfig, train: Sequence[Any], eval_sets: Sequence[EvalSet]) -> None:
    """Raise DatasetError when the reward set cannot score the training records or an evaluation set's."""
    demos = cfg.experiment.warmup_demos
    if cfg.experiment.warmup == "sft" and train and demos > len(train):
        raise DatasetError(f"experiment.warmup_demos={demos} asks for more demonstrations than the {len(train):,} "
                           "records of data.train_path hold: lower it, or set 0 to use every record")
    reward_set = run_reward_set(cfg)
    named = [("data.train_path", train)] * bool(train) + [(f"data.eval_sets.{s.name}", s.items) for s in eval_sets]
    by_source = cfg.rewards.by_source
    for field, items in named:
        columns = {name for item in items for name in item.columns}
        for name in reward_set.names:
            reward = reward_set.reward(name)
            if reward.style == "columns":
                # An agent's returned fields are columns too, known only when it returns: any name may be one.
                extra = set(inspect.signature(reward.fn).parameters) if cfg.rollout.agent else set()
                problem = columns_problem(reward.fn, columns | extra)
                if problem is not None:
                    raise DatasetError(f"reward {name!r} cannot score {field}: {problem}")
        math_rewards = [n for n in reward_set.names if reward_set.reward(n).needs_numbers]
        label_rewards = [n for n in reward_set.names if needs_label(reward_set.reward(n))]
        for item in items:
            where = getattr(item, "where", field)
            if getattr(item, "messages", None) is not None and not cfg.data.chat_template:
                raise DatasetError(f"{where}: the prompt is chat messages, which only a chat template renders; "
                                   "data.chat_template=false feeds string prompts as they are: set it to true, or "
                                   "give string prompts")
            applies = [n for n in label_rewards if reward_set.reward(n).source in (None, item.source)]
            if applies and item.label is None:
                raise DatasetError(f"{where}: missing key {cfg.data.label_key!r} (data.label_key): the record has no "
                                   f"label, which the rewards {applies} compare with; set data.label_key to the "
                                   "column that holds it, or score label-less data with plug-ins that need none "
                                   "(rewards.set=none, rewards.custom)")
            if by_source and item.source not in by_source:
                raise DatasetError(f"{where}: data source {item.source!r} has no reward function; add "
                                   f"rewards.by_source.{item.source}=package.module:fn (sources with one: "
                                   f"{', '.join(sorted(by_source))})" if item.source is not None else
                                   f"{where}: the record has no data source, which rewards.by_source needs; set "
                                   "data.source_key or give every record a data_source column")
            applies = [n for n in math_rewards if reward_set.reward(n).source in (None, item.source)]
            if applies and math.isnan(item.answer):
                raise DatasetError(f"{getattr(item, 'where', field)}: label {item.label!r} is not a number, which the "
                                   f"math rewards {applies} need; score records with rewards.set=exact_match, or "
                                   "rewards.set=none with rewards.custom")
