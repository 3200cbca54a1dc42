"""The records that cross the seams between data, rollout, rewards, algorithms and the trainer.

Token sequences are plain `list[int]` / `tuple[int, ...]` (ragged, never padded) so that the trainer
can pack them by token budget; per-token floats line up one-to-one with `response_ids`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings, in SGLang's `sampling_params` vocabulary."""

    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # Optional per-request seed (reference engine honours it; SGLang uses `sampling_seed`).
    seed: int | None = None

    def to_sglang(self) -> dict[str, Any]:
        """The `sampling_params` JSON object of SGLang's `/generate`."""
        params: dict[str, Any] = {
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "ignore_eos": self.ignore_eos,
        }
        if self.stop:
            params["stop"] = list(self.stop)
        if self.stop_token_ids:
            params["stop_token_ids"] = list(self.stop_token_ids)
        if self.seed is not None:
            params["sampling_seed"] = self.seed
        return params


@dataclass(frozen=True)
class Generation:
    """One engine answer: the sampled tokens, their logprobs under the engine's weights, and why it stopped.

    `output_logprobs[i]` is log p(output_ids[i] | prefix) in nats, computed by the engine from the raw
    (temperature-free) distribution, as SGLang reports `output_token_logprobs`.
    """

    output_ids: tuple[int, ...]
    output_logprobs: tuple[float, ...]
    # "stop" (EOS or a stop string/token), "length" (max_new_tokens), "abort".
    finish_reason: str
    weight_version: str
    engine_id: str = ""
    latency_s: float = 0.0
    # `return_routed_experts` answers (MoE): SGLang's flat int32 expert ids of every position the engine ran.
    routed_experts: Any = None


@dataclass
class Sample:
    """One completion of one prompt, with everything the rollout table records."""

    prompt_index: int
    prompt_ids: list[int]
    response_ids: list[int]
    rollout_logprobs: list[float]
    response_text: str = ""
    finish_reason: str = ""
    engine_id: str = ""
    weight_version: str = ""
    # Raw value of every reward function, plus "total" (the weighted sum).
    rewards: dict[str, float] = field(default_factory=dict)
    # Multi-turn rollouts: 1 per response token the model sampled, 0 for environment replies (no loss,
    # rollout log-prob 0.0); None when every token is the model's.
    loss_mask: list[int] | None = None
    # Model turns in the response (1 for a single-turn rollout).
    turns: int = 1
    # MoE models: the engine's expert ids of the generated tokens it ran, `[R - 1, MoE layers, top_k]` int8/int16
    # numpy (rollout/routing.py), or None.
    routed_experts: Any = None
    # What reward plug-ins logged for this completion with `log_extra(column, values)`: column -> value.
    extra: dict[str, Any] = field(default_factory=dict)
    # What the agent plug-in returned for this sample (`rollout.agent`): its `reward` and any other fields.
    agent: dict[str, Any] | None = None

    @property
    def reward(self) -> float:
        """The weighted total reward (0.0 before scoring)."""
        return self.rewards.get("total", 0.0)

    @property
    def environment_replies(self) -> int:
        """Environment replies in the response (its tool calls answered): runs of 0 in the loss mask."""
        mask = self.loss_mask or []
        return sum(1 for i, m in enumerate(mask) if m == 0 and (i == 0 or mask[i - 1] == 1))


@dataclass
class Group:
    """The `group_size` completions of one prompt; GRPO-style estimators use it as its own baseline."""

    prompt_index: int
    prompt_text: str
    question: str
    answer: float
    steps: tuple[float, ...]
    samples: list[Sample] = field(default_factory=list)
    # The record the prompt came from (`data.records.Record`, or a math problem): the rewards read its
    # label, source and columns. None: only `question`, `answer` and `steps` are known.
    record: Any = None

    @property
    def source(self) -> str | None:
        return getattr(self.record, "source", None)

    @property
    def rewards(self) -> list[float]:
        return [s.reward for s in self.samples]

    @property
    def is_zero_signal(self) -> bool:
        """All completions earned the same reward: the group carries no policy-gradient signal."""
        rewards = self.rewards
        return len(rewards) > 0 and max(rewards) - min(rewards) < 1e-8


@dataclass(frozen=True)
class TrainBatch:
    """Sequences ready for the trainer, ragged; index i is one completion.

    - `tokens[i]`: prompt + response token ids, length P_i + R_i.
    - `prompt_lengths[i]`: P_i; the loss covers positions P_i .. P_i + R_i - 1 (the response).
    - `rollout_logprobs[i]`: R_i engine logprobs of the response tokens (nats).
    - `advantages[i]`: one float per completion (broadcast over its response tokens).
    - `ref_logprobs` / `teacher_logprobs`: optional R_i floats each, filled by the trainer.
    - `old_logprobs`: optional R_i floats, the trainer's log-probs before the first of several
      updates on this batch (PPO's "old" policy); filled by the trainer when
      `algo.updates_per_rollout * algo.epochs_per_rollout > 1`.
    """

    tokens: list[list[int]]
    prompt_lengths: list[int]
    rollout_logprobs: list[list[float]]
    advantages: list[float]
    ref_logprobs: list[list[float]] | None = None
    teacher_logprobs: list[list[float]] | None = None
    old_logprobs: list[list[float]] | None = None
    # R_i ints each (1: the token is trained on, 0: an environment reply of a multi-turn rollout, left out
    # of the loss and of the mismatch metrics); None: every response token counts.
    loss_masks: list[list[int]] | None = None
    # MoE rollout routing: per sequence, the engine's expert ids `[R_i - 1, MoE layers, top_k]` (int8 or
    # int16 numpy) of the generated tokens it fed back (positions P_i .. P_i + R_i - 2), or None.
    routed_experts: list[Any] | None = None

    def __post_init__(self) -> None:
        n = len(self.tokens)
        if self.routed_experts is not None and len(self.routed_experts) != n:
            raise ValueError(f"TrainBatch.routed_experts has {len(self.routed_experts)} entries for {n} sequences")
        if self.loss_masks is not None:
            if len(self.loss_masks) != n:
                raise ValueError(f"TrainBatch.loss_masks has {len(self.loss_masks)} entries for {n} sequences")
            for i, (toks, plen, m) in enumerate(zip(self.tokens, self.prompt_lengths, self.loss_masks, strict=True)):
                if len(toks) - plen != len(m):
                    raise ValueError(f"TrainBatch sequence {i}: {len(toks) - plen} response tokens but a loss mask "
                                     f"of {len(m)}")
        for name in ("prompt_lengths", "rollout_logprobs", "advantages"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"TrainBatch.{name} has {len(getattr(self, name))} entries for {n} sequences")
        for i, (toks, plen, lps) in enumerate(zip(self.tokens, self.prompt_lengths, self.rollout_logprobs,
                                                   strict=True)):
            if len(toks) - plen != len(lps):
                raise ValueError(
                    f"TrainBatch sequence {i}: {len(toks) - plen} response tokens but {len(lps)} rollout logprobs"
                )

    @classmethod
    def without_rollout(cls, sequences: Sequence[Sequence[int]], prompt_lengths: Sequence[int]) -> TrainBatch:
        """`sequences` with no rollout data (zero log-probs and advantages): for scoring or SFT, where only
        `tokens` and `prompt_lengths` are read."""
        seqs = [list(s) for s in sequences]
        plens = list(prompt_lengths)
        return cls(tokens=seqs, prompt_lengths=plens,
                   rollout_logprobs=[[0.0] * (len(s) - p) for s, p in zip(seqs, plens, strict=True)],
                   advantages=[0.0] * len(seqs))

    def subset(self, indices: Sequence[int]) -> TrainBatch:
        """The sequences at `indices`, in that order, with every per-sequence field."""
        def rows(values: list[Any] | None) -> list[Any] | None:
            return None if values is None else [values[i] for i in indices]

        return TrainBatch(tokens=rows(self.tokens) or [], prompt_lengths=rows(self.prompt_lengths) or [],
                          rollout_logprobs=rows(self.rollout_logprobs) or [], advantages=rows(self.advantages) or [],
                          ref_logprobs=rows(self.ref_logprobs), teacher_logprobs=rows(self.teacher_logprobs),
                          old_logprobs=rows(self.old_logprobs), loss_masks=rows(self.loss_masks),
                          routed_experts=rows(self.routed_experts))

    @property
    def num_sequences(self) -> int:
        return len(self.tokens)

    @property
    def num_tokens(self) -> int:
        """Real tokens (prompt + response) across the batch."""
        return sum(len(t) for t in self.tokens)

    @property
    def response_lengths(self) -> list[int]:
        return [len(t) - p for t, p in zip(self.tokens, self.prompt_lengths, strict=True)]

    @property
    def loss_token_counts(self) -> list[int]:
        """Response tokens of each sequence that the loss covers (all of them without `loss_masks`)."""
        if self.loss_masks is None:
            return self.response_lengths
        return [sum(1 for v in m if v) for m in self.loss_masks]

@dataclass(frozen=True)
class PromptSpec:
    """One prompt to sample a group for.

    `prompt_ids` are the rendered prompt's token ids (P tokens); `question`, `answer` and `steps`
    are the reference data the rewards need; `prompt_text` is kept for the rollout table.
    """

    prompt_index: int
    prompt_ids: tuple[int, ...]
    prompt_text: str = ""
    question: str = ""
    answer: float = 0.0
    steps: tuple[float, ...] = ()
    # The record the prompt was rendered from (see `Group.record`).
    record: Any = None

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError(f"prompt {self.prompt_index}: prompt_ids is empty; render and tokenize the prompt first")
        if any(not isinstance(t, int) or t < 0 for t in self.prompt_ids):
            raise ValueError(f"prompt {self.prompt_index}: prompt_ids must be non-negative ints")
