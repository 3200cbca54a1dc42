"""Prompt format: the system prompt and rendering of prompts and targets in the answer format.

The tags and number formatting come from `miles_lite.answer_format`, which the reward functions
score completions against.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from miles_lite.answer_format import SOLUTION_END, SOLUTION_START, WORK_END, WORK_START, format_number
from miles_lite.data.gsm8k import MathProblem, strip_annotations

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

SYSTEM_PROMPT = (
    "You are given a math problem. Think about it and write your working out between "
    f"{WORK_START} and {WORK_END}. Then write only the final number between "
    f"{SOLUTION_START} and {SOLUTION_END}."
)


def build_messages(question: str) -> list[dict[str, str]]:
    """Chat messages for one problem: the system prompt, then the question as the user turn."""
    return [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": question},
    ]


def render_plain_prompt(question: str) -> str:
    """The prompt used when the tokenizer has no chat template."""
    return f"System: {SYSTEM_PROMPT}\nUser: {question}\nAssistant: "


def render_prompt(tokenizer: PreTrainedTokenizerBase | Any | None, question: str) -> str:
    """Render the prompt text (not token ids) that the policy continues for ``question``.

    Uses ``tokenizer.apply_chat_template(..., add_generation_prompt=True, tokenize=False)``
    when the tokenizer has a chat template; otherwise (or with ``tokenizer=None``) falls back
    to :func:`render_plain_prompt`.
    """
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(
            build_messages(question), add_generation_prompt=True, tokenize=False
        )
    return render_plain_prompt(question)


def format_solution(problem: MathProblem) -> str:
    """The target completion for supervised warm-up, in the tagged answer format.

    The working out is the reference solution without its ``#### N`` line and with the
    ``<<...>>`` calculator annotations removed (``3*4=<<3*4=12>>12`` becomes ``3*4=12``); the
    solution block holds the final answer formatted without a trailing ``.0``.
    """
    body = problem.solution
    marker = body.rfind("####")
    if marker >= 0:
        body = body[:marker]
    lines = (strip_annotations(line).strip() for line in body.splitlines())
    working = "\n".join(line for line in lines if line)
    return f"{WORK_START}{working}{WORK_END}{SOLUTION_START}{format_number(problem.answer)}{SOLUTION_END}"
