"""Greedy evaluation on held-out problems, reported as the worklog's baseline table."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace

from miles_lite.data.calculator import call_outcomes
from miles_lite.data.gsm8k import MathProblem
from miles_lite.rewards import score_completions
from miles_lite.rewards.math import solution_text
from miles_lite.rollout.prompt_spec import PromptSpec
from miles_lite.rollout.sync_api import SyncRolloutManager
from miles_lite.types import Group, SamplingParams


@dataclass(frozen=True)
class EvalResult:
    """Shares (0..1) over `n` problems, one greedy completion each."""

    n: int
    right_number_anywhere: float
    right_number_in_solution: float
    exact_format: float
    exact: float
    with_solution_block: int
    # Multi-turn runs: environment replies (tool calls answered) per answer, and the share of calls whose
    # value is an intermediate result of the reference solution (calculator format; 0.0 without calls).
    tool_calls: float = 0.0
    correct_calls: float = 0.0

    def table(self, title: str = "evaluation") -> str:
        """The worklog's baseline table as plain text."""
        rows = [
            ("right number anywhere", self.right_number_anywhere),
            ("right number inside SOLUTION", self.right_number_in_solution),
            ("exact tag format", self.exact_format),
            ("right answer and exact format", self.exact),
        ]
        lines = [f"{title} ({self.n} problems, greedy)"]
        lines += [f"  {name:<32}{value * 100:6.1f}%" for name, value in rows]
        lines.append(f"  {'answers with a SOLUTION block':<32}{self.with_solution_block:4d} / {self.n}")
        if self.tool_calls:
            lines.append(f"  {'tool calls per answer':<32}{self.tool_calls:6.2f}")
            lines.append(f"  {'calls on a reference step':<32}{self.correct_calls * 100:6.1f}%")
        return "\n".join(lines)

    def as_dict(self) -> dict[str, float]:
        return {k: float(v) for k, v in asdict(self).items()}


def summarise(completions: Sequence[str], problems: Sequence[MathProblem]) -> EvalResult:
    """Score completions (aligned with `problems`) into an `EvalResult`."""
    scores = score_completions(list(completions), [p.answer for p in problems], [p.question for p in problems],
                               steps=[p.steps for p in problems])
    n = max(len(scores), 1)

    def share(name: str) -> float:
        return sum(s[name] for s in scores) / n

    return EvalResult(
        n=len(scores),
        right_number_anywhere=share("lenient_correctness_check"),
        right_number_in_solution=share("correctness_check"),
        exact_format=share("format_check"),
        exact=share("exact_check"),
        with_solution_block=sum(solution_text(c) is not None for c in completions),
    )


def evaluate(manager: SyncRolloutManager, problems: Sequence[MathProblem], render: Callable[[str], str],
             encode: Callable[[str], list[int]], sampling: SamplingParams) -> EvalResult:
    """Decode each problem once, greedily (temperature 0), through the rollout engines."""
    greedy = replace(sampling, temperature=0.0, top_p=1.0, top_k=-1, seed=None)
    specs = []
    for i, p in enumerate(problems):
        text = render(p.question)
        # The problem rides along as the record (an agent plug-in reads it).
        specs.append(PromptSpec(i, tuple(encode(text)), text, p.question, p.answer, p.steps, record=p))
    groups: list[Group] = manager.generate_groups(specs, 1, greedy)
    by_index = {g.prompt_index: g.samples[0] for g in groups}
    if len(by_index) != len(problems):
        raise RuntimeError(f"evaluation got {len(by_index)} completions for {len(problems)} problems")
    samples = [by_index[i] for i in range(len(problems))]
    result = summarise([s.response_text for s in samples], problems)
    calls = sum(s.environment_replies for s in samples)
    if not calls:
        return result
    outcomes = [call_outcomes(s.response_text, p.steps) for s, p in zip(samples, problems, strict=True)]
    answered = sum(n for n, _ in outcomes)
    return replace(result, tool_calls=calls / len(samples),
                   correct_calls=sum(ok for _, ok in outcomes) / answered if answered else 0.0)
