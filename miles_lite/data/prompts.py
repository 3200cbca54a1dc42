"""Prompt format: the system prompt and rendering of prompts and targets in the answer format.

The tags and number formatting come from `miles_lite.formats.answer`, which the reward functions
score completions against.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from miles_lite.data.gsm8k import MathProblem, strip_annotations
from miles_lite.formats.answer import (
    CALC_END,
    CALC_START,
    RESULT_END,
    RESULT_START,
    SOLUTION_END,
    SOLUTION_START,
    WORK_END,
    WORK_START,
    format_number,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

SYSTEM_PROMPT = (
    "You are given a math problem. Think about it and write your working out between "
    f"{WORK_START} and {WORK_END}. Then write only the final number between "
    f"{SOLUTION_START} and {SOLUTION_END}."
)

# The worklog's system prompt: one worked example of the whole format, and an explicit ban on the
# \boxed{} answers an instruct model falls back to (the worklog credits both with ending its format
# failures).
WORKLOG_SYSTEM_PROMPT = (
    "You are given a math problem. Think about the problem and write your working out between "
    f"{WORK_START} and {WORK_END}. Then write the final answer between {SOLUTION_START} and "
    f"{SOLUTION_END}: only the number, with no units, no $ sign and no \\boxed{{}}.\n"
    "Example:\n"
    "Question: A box holds 3 rows of 4 eggs. How many eggs are in 6 boxes?\n"
    f"{WORK_START}Each box holds 3*4=12 eggs. 6 boxes hold 6*12=72 eggs.{WORK_END}"
    f"{SOLUTION_START}72{SOLUTION_END}"
)

# For runs with the calculator tool (rollout.environment=calculator): how to call it.
CALCULATOR_SYSTEM_PROMPT = (f"{SYSTEM_PROMPT} To compute, write {CALC_START}expression{CALC_END}: its value follows "
                            f"as {RESULT_START}value{RESULT_END}.")

# `data.prompt_template` -> system prompt. "none": the question alone, for a model trained from scratch,
# which learns the format from its SFT targets and cannot read instructions; a system prompt would only
# make every sequence longer (the default's is 50 of an 80-token prompt).
PROMPT_TEMPLATES = {"default": SYSTEM_PROMPT, "worklog": WORKLOG_SYSTEM_PROMPT, "calculator": CALCULATOR_SYSTEM_PROMPT,
                    "none": ""}


def system_prompt(template: str = "default") -> str:
    """The system prompt of `data.prompt_template` (one of :data:`PROMPT_TEMPLATES`; "" for none)."""
    try:
        return PROMPT_TEMPLATES[template]
    except KeyError:
        raise ValueError(f"data.prompt_template={template!r} is not one of {', '.join(PROMPT_TEMPLATES)}") from None


def build_messages(question: str, template: str = "default") -> list[dict[str, str]]:
    """Chat messages for one problem: the system prompt (if the template has one), then the question as the
    user turn."""
    system = system_prompt(template)
    user = {"role": "user", "content": question}
    return [{"role": "system", "content": system}, user] if system else [user]


def render_plain_prompt(question: str, template: str = "default") -> str:
    """The prompt used when the tokenizer has no chat template."""
    system = system_prompt(template)
    return f"System: {system}\nUser: {question}\nAssistant: " if system else f"User: {question}\nAssistant: "


def render_prompt(tokenizer: PreTrainedTokenizerBase | Any | None, question: str, template: str = "default") -> str:
    """Render the prompt text (not token ids) that the policy continues for ``question``.

    Uses ``tokenizer.apply_chat_template(..., add_generation_prompt=True, tokenize=False)``
    when the tokenizer has a chat template; otherwise (or with ``tokenizer=None``) falls back
    to :func:`render_plain_prompt`. ``template`` picks the system prompt (``data.prompt_template``).
    """
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(
            build_messages(question, template), add_generation_prompt=True, tokenize=False
        )
    return render_plain_prompt(question, template)


def render_messages(tokenizer: PreTrainedTokenizerBase | Any | None, messages: Sequence[Mapping[str, str]]) -> str:
    """A record's chat messages as the prompt text: the tokenizer's chat template with
    ``add_generation_prompt``, or (no template) one ``Role: content`` line each and ``Assistant: ``."""
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template([dict(m) for m in messages], add_generation_prompt=True,
                                             tokenize=False)
    lines = [f"{m['role'].capitalize()}: {m['content']}" for m in messages]
    return "\n".join(lines) + "\nAssistant: "


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
