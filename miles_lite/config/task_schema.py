"""What a run learns from: the data (math problems or records with a key mapping), the evaluation sets
and the rewards. Composed into `MilesConfig` by `schema.py`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from miles_lite.config.fields import bounded, one_of


@dataclass
class PresampleConfig:
    """Presampling filter: k samples per question, drop the all-wrong and all-right ones."""

    enabled: bool = True
    k: int = bounded(8, ge=1)
    # Math problems: strict = exact_check (answer and format); lenient = the last number in the text is right.
    # Records: strict = the total reward reaches the most the reward set gives (full marks); lenient = the total
    # is above zero (some reward earned).
    scoring: str = one_of("lenient", "strict")
    drop_all_wrong: bool = True
    drop_all_right: bool = True
    max_new_tokens: int | None = None
    # Presample only the first N training questions and train on the kept ones (0 = all questions).
    max_questions: int = bounded(0, ge=0)


@dataclass
class SyntheticDataConfig:
    """Offline GSM8K-format arithmetic problems."""

    train_size: int = bounded(2000, ge=1)
    eval_size: int = bounded(64, ge=0)
    min_steps: int = 1
    max_steps: int = 2
    min_operand: int = 1
    max_operand: int = 9
    ops: list[str] = field(default_factory=lambda: ["+", "-", "*"])
    max_result: int = 200  # bound on every intermediate result (>= max_operand)
    seed: int = 0


@dataclass
class EvalSetConfig:
    """One named held-out set: its file (read like the training data), its sampling and how many samples
    a prompt gets. A sample is correct when its total reward reaches `threshold` (None: the most the
    reward set can give that sample)."""

    # A records file, several (a list) or a glob, read like data.train_path.
    path: Any = None
    k: int = bounded(1, ge=1)
    # None: greedy (0) for k = 1, rollout.temperature for k > 1 (k greedy samples would be one answer k times,
    # so an explicit 0 with k > 1 is refused).
    temperature: float | None = bounded(None, ge=0)
    # None: rollout.top_p.
    top_p: float | None = bounded(None, gt=0, le=1)
    # None: rollout.max_new_tokens.
    max_new_tokens: int | None = bounded(None, ge=1)
    threshold: float | None = None
    # Evaluate the first N prompts only (0: all).
    size: int = bounded(0, ge=0)

    def sampling_temperature(self, run_temperature: float) -> float:
        """The temperature the set samples at: its own, else greedy for k = 1 and the run's for k > 1."""
        if self.temperature is not None:
            return self.temperature
        return 0.0 if self.k == 1 else run_temperature


@dataclass
class DataConfig:
    """Where prompts come from."""

    # synthetic (seeded arithmetic) | gsm8k (question/answer files) | records (any jsonl/parquet, key mapping below)
    source: str = one_of("synthetic", "gsm8k", "records")
    # GSM8K jsonl/parquet files (source=gsm8k); records (source=records): a .jsonl, .json (JSON Lines or one
    # array), .parquet or .arrow file, a `datasets` save_to_disk folder, a list of any of these, or a glob.
    train_path: Any = None
    eval_path: Any = None
    # Records: the prompt is the column `prompt_key` (a string, or a list of {role, content} chat messages as
    # in TRL's conversational data), or the chat messages of `messages_key`; exactly one of the two.
    prompt_key: str | None = None
    messages_key: str | None = None
    # Records: render prompts with the tokenizer's chat template (add_generation_prompt). false: a string
    # prompt is fed as it is (as TRL feeds standard, non-conversational data); chat messages need the template.
    chat_template: bool = True
    # The label column, any JSON value, handed to the rewards as it is; records may lack it (label-less
    # data), unless a reward needs it.
    label_key: str = "label"
    # Optional columns: metadata (any JSON value), the data source (routes `rewards.by_source`; the column
    # `data_source` is used when present and this is unset), a reference response (the SFT warm-up's target).
    metadata_key: str | None = None
    source_key: str | None = None
    response_key: str | None = None
    # Named held-out sets, each evaluated before RL, every experiment.eval_every steps and after RL.
    eval_sets: dict[str, EvalSetConfig] = field(default_factory=dict)
    synthetic: SyntheticDataConfig = field(default_factory=SyntheticDataConfig)
    shuffle_seed: int = 0
    max_prompt_tokens: int = 512
    # System prompt of math problems: default (the format in one sentence) | worklog (the format, a worked
    # example, and no boxed answers) | calculator (the format and how to call the calculator tool) | none
    # (the question alone: a model trained from scratch learns the format from its SFT targets). Records
    # render their own prompt or messages and take no system prompt from here.
    prompt_template: str = one_of("default", "worklog", "calculator", "none")
    presample: PresampleConfig = field(default_factory=PresampleConfig)


@dataclass
class RemoteRewardConfig:
    """A reward model behind HTTP (protocol in `miles_lite/rewards/remote.py`), scored beside the others."""

    # POST endpoint, e.g. http://reward-model:8000/score; None: no remote reward.
    url: str | None = None
    # Its column in the rollout table and metrics, its weight in the total, its largest score.
    name: str = "remote"
    weight: float = 1.0
    max_score: float = 1.0
    batch_size: int = 32
    timeout_s: float = 30.0
    retries: int = 3  # attempts after the first (exponential backoff from backoff_s), then the run stops
    backoff_s: float = 0.5
    max_concurrency: int = 4


@dataclass
class RewardsConfig:
    """Weighted reward set; `weights` overrides or extends the named set's weights."""

    # A named set (worklog, correctness_only, format_only, exact_match, math_answer), or none: plug-ins and
    # the remote reward model only.
    set: str = "worklog"
    weights: dict[str, float] = field(default_factory=dict)
    # Plug-ins, one or a list (TRL's reward_funcs): "package.module:fn" (a batch reward function, added to the
    # set under its name, weight 1.0 unless `weights` names it; or a RewardSet, which replaces `set`),
    # "package.module:factory(arg=value, ...)" (the function a factory returns), or a block {fn, kwargs, name,
    # max_value} (miles_lite/rewards/specs.py).
    custom: Any = None
    # Data source -> plug-in "package.module:fn": each record is scored by the function of its source
    # (the others return None for it); every source in the data needs one.
    by_source: dict[str, str] = field(default_factory=dict)
    # The `exact_match` reward compares this regex's match (its first group, if any) in the completion with
    # the label; None: the whole completion.
    answer_pattern: str | None = None
    # Seconds one reward function may take over one batch (it runs in a worker, off the rollout loop); past
    # it the run fails naming the reward. The remote reward model has its own `remote.timeout_s`.
    timeout_s: float = bounded(600.0, gt=0)
    remote: RemoteRewardConfig = field(default_factory=RemoteRewardConfig)

