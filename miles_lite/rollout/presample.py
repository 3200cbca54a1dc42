"""Presampling: k completions per question, pass@k, and a data set without zero-signal questions.

A question the policy always fails (0/k) or always solves (k/k) gives GRPO groups with identical
rewards, so it costs rollout time and teaches nothing. Presampling measures this once, before
training: each question is sampled k times and scored two ways,

- strict: `exact_check` (the right number inside a well-formed answer block), and
- lenient: the last number anywhere in the completion equals the answer,

then pass@1..k is estimated with the unbiased estimator of Chen et al. (2021) and the questions
whose count under the chosen scoring is 0/k or k/k are dropped. A record (not a math problem) is scored
by the run's reward set instead:

- strict: the sample's total reward reaches the most the set can give a record of its source (full marks);
- lenient: its total is above zero (it earned some reward: partial credit counts).

With a reward that gives only 0 or its maximum (`exact_match`, `math_answer`) the two agree; with partial
credit, lenient 0/k means no sample earned anything (a group of zeros) and strict k/k that every sample got
full marks.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from miles_lite.config.schema import PresampleConfig
from miles_lite.data.gsm8k import MathProblem
from miles_lite.formats.answer import answer_matches, find_numbers
from miles_lite.formats.files import write_atomic
from miles_lite.rewards import RewardSet, score_groups
from miles_lite.rewards.context import RewardContext
from miles_lite.rewards.math import score_exact
from miles_lite.rewards.success import right_flags
from miles_lite.rollout.manager import RolloutManager
from miles_lite.rollout.prompt_spec import PromptSpec
from miles_lite.types import Group, SamplingParams

SCORINGS = ("strict", "lenient")
# A total reward is a float sum of weighted rewards: "reaches" and "above zero" allow for its rounding.
TOLERANCE = 1e-9


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from `n` samples of which `c` are correct: 1 - C(n-c, k) / C(n, k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def strict_correct(completion: str, answer: float) -> bool:
    """`exact_check`: the format is exact and the SOLUTION block holds the answer."""
    return score_exact(completion, answer) == 1.0


def lenient_correct(completion: str, answer: float) -> bool:
    """The last number written anywhere in the completion is the answer (`answer_matches`)."""
    numbers = find_numbers(completion)
    return bool(numbers) and answer_matches(numbers[-1], answer)


@dataclass(frozen=True)
class QuestionResult:
    """How many of the k samples of one question were right, under each scoring."""

    index: int
    question: str
    answer: float
    k: int
    strict: int
    lenient: int

    def correct(self, scoring: str) -> int:
        return self.strict if scoring == "strict" else self.lenient


@dataclass
class PresampleReport:
    """Per-question counts, pass@1..k under both scorings, and the filter's outcome."""

    k: int
    scoring: str
    results: list[QuestionResult]
    pass_strict: list[float] = field(default_factory=list)
    pass_lenient: list[float] = field(default_factory=list)
    all_wrong: int = 0
    all_right: int = 0
    kept_indices: list[int] = field(default_factory=list)

    def summary_line(self) -> str:
        """e.g. "2,009 questions 0/8 and 84 8/8, leaving 5,380" (counts under `scoring`)."""
        k = self.k
        return (f"{self.all_wrong:,} questions 0/{k} and {self.all_right:,} {k}/{k}, "
                f"leaving {len(self.kept_indices):,}")

    def table(self) -> str:
        """The pass@k table as aligned text: one row per k, strict and lenient columns."""
        lines = [f"{'k':>4}  {'strict':>8}  {'lenient':>8}"]
        for j in range(self.k):
            lines.append(f"{j + 1:>4}  {self.pass_strict[j]:>8.4f}  {self.pass_lenient[j]:>8.4f}")
        return "\n".join(lines)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)


def summarise(results: Sequence[QuestionResult], k: int, cfg: PresampleConfig) -> PresampleReport:
    """pass@1..k averaged over questions, and which questions the filter keeps."""
    if cfg.scoring not in SCORINGS:
        raise ValueError(f"data.presample.scoring must be one of {SCORINGS}, got {cfg.scoring!r}")
    report = PresampleReport(k=k, scoring=cfg.scoring, results=list(results))
    n = max(len(results), 1)
    report.pass_strict = [sum(pass_at_k(k, r.strict, j) for r in results) / n for j in range(1, k + 1)]
    report.pass_lenient = [sum(pass_at_k(k, r.lenient, j) for r in results) / n for j in range(1, k + 1)]
    for r in results:
        c = r.correct(cfg.scoring)
        report.all_wrong += c == 0
        report.all_right += c == k
        if (c == 0 and cfg.drop_all_wrong) or (c == k and cfg.drop_all_right):
            continue
        report.kept_indices.append(r.index)
    return report


def count_correct(group: Group, problem: Any, reward_set: RewardSet | None = None,
                  context: RewardContext | None = None) -> QuestionResult:
    """Score one group of k completions of `problem` strictly and leniently: a math problem by its answer, any
    other record by `reward_set` (strict: the reward set's best, `rewards.success`; lenient: a total above
    zero). `context`: the trainer state reward plug-ins see."""
    texts = [s.response_text for s in group.samples]
    if not isinstance(problem, MathProblem):
        if reward_set is None:
            raise ValueError("presampling records needs the run's reward set")
        score_groups(reward_set, [group], context)
        strict = sum(right_flags(reward_set, [s.rewards for s in group.samples], [problem.source] * len(texts)))
        lenient = sum(s.reward > TOLERANCE for s in group.samples)
        return QuestionResult(group.prompt_index, problem.question, problem.answer, len(texts), strict, lenient)
    return QuestionResult(
        index=group.prompt_index,
        question=problem.question,
        answer=problem.answer,
        k=len(texts),
        strict=sum(strict_correct(t, problem.answer) for t in texts),
        lenient=sum(lenient_correct(t, problem.answer) for t in texts),
    )


async def presample(
    manager: RolloutManager,
    problems: Sequence[Any],
    render: Callable[[Any], str],
    encode: Callable[[str], list[int]],
    cfg: PresampleConfig,
    sampling: SamplingParams,
    *,
    reward_set: RewardSet | None = None,
    context: RewardContext | None = None,
    chunk_size: int = 64,
    progress: Callable[[int, int], None] | None = None,
) -> PresampleReport:
    """Sample `cfg.k` completions of every problem and summarise them.

    `render(problem) -> prompt text` and `encode(text) -> token ids` build each prompt; the
    manager needs a `decode` so completions have text. Problems are sent `chunk_size` at a time so
    memory stays flat on large data sets; `progress(done, total)` is called after each chunk.
    """
    if cfg.k < 1:
        raise ValueError(f"data.presample.k must be >= 1, got {cfg.k}")
    if manager.decode is None:
        raise ValueError("presample needs a RolloutManager built with decode= (completions are scored as text)")
    if cfg.max_new_tokens is not None:
        sampling = replace(sampling, max_new_tokens=cfg.max_new_tokens)
    results: list[QuestionResult] = []
    for start in range(0, len(problems), chunk_size):
        chunk = problems[start:start + chunk_size]
        specs = []
        for offset, problem in enumerate(chunk):
            text = render(problem)
            specs.append(PromptSpec(start + offset, tuple(encode(text)), text, problem.question, problem.answer,
                                    problem.steps, record=problem))
        groups = await manager.generate_groups(specs, cfg.k, sampling)
        if len(groups) != len(specs):
            raise RuntimeError(f"presample got {len(groups)} groups for {len(specs)} questions (was it aborted?)")
        results.extend(count_correct(g, problems[g.prompt_index], reward_set, context) for g in groups)
        if progress is not None:
            progress(len(results), len(problems))
    return summarise(results, cfg.k, cfg)


def write_filtered(problems: Sequence[MathProblem], report: PresampleReport, path: str | Path) -> Path:
    """Save the kept problems in GSM8K format (.jsonl/.json/.parquet) and the report beside them.

    The report goes to `<path stem>.presample.json` (per-question counts and the pass@k curves).
    """
    from miles_lite.data.gsm8k import save_gsm8k

    out = save_gsm8k([problems[i] for i in report.kept_indices], path)
    write_atomic(out.with_name(f"{out.stem}.presample.json"), report.to_json() + "\n")
    return out
