"""Prompt rendering and tagged solution targets."""

from __future__ import annotations

import pytest

from miles_lite.data import (
    SYSTEM_PROMPT,
    ArithmeticSpec,
    MathProblem,
    build_messages,
    format_solution,
    generate_problems,
    render_prompt,
)
from miles_lite.formats.answer import ANSWER_TAGS, SOLUTION_END, SOLUTION_START, WORK_END, WORK_START
from miles_lite.rewards import score_completions
from miles_lite.rewards.math import relevant_steps

NATALIA = MathProblem.from_record(
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
    "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n"
    "#### 72",
)


class ChatTokenizer:
    chat_template = "{{ messages }}"

    def apply_chat_template(self, messages, *, add_generation_prompt: bool, tokenize: bool) -> str:
        assert add_generation_prompt and not tokenize
        return "|".join(f"{m['role']}:{m['content']}" for m in messages) + "|assistant:"


class PlainTokenizer:
    chat_template = None


def test_tags_and_system_prompt() -> None:
    assert ANSWER_TAGS == ("<start_working_out>", "<end_working_out>", "<SOLUTION>", "</SOLUTION>")
    assert all(tag in SYSTEM_PROMPT for tag in ANSWER_TAGS)
    assert build_messages("What is 2+2?") == [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": "What is 2+2?"},
    ]


def test_render_prompt_uses_chat_template_when_present() -> None:
    assert render_prompt(ChatTokenizer(), "Q?") == f"system:{SYSTEM_PROMPT}|user:Q?|assistant:"


@pytest.mark.parametrize("tokenizer", [None, PlainTokenizer()])
def test_render_prompt_falls_back_to_plain_template(tokenizer) -> None:
    assert render_prompt(tokenizer, "Q?") == f"System: {SYSTEM_PROMPT}\nUser: Q?\nAssistant: "


def test_format_solution_strips_annotations_and_keeps_math() -> None:
    text = format_solution(NATALIA)
    assert text == (
        f"{WORK_START}Natalia sold 48/2 = 24 clips in May.\n"
        f"Natalia sold 48+24 = 72 clips altogether in April and May.{WORK_END}"
        f"{SOLUTION_START}72{SOLUTION_END}"
    )
    generated = generate_problems(1, ArithmeticSpec(min_steps=2, max_steps=2, ops=("*",), seed=0))[0]
    working = format_solution(generated)
    assert "<<" not in working and "####" not in working
    a, b = generated.solution.split("\n")[0].split("=")[0].split("*")
    assert f"{a}*{b}={int(a) * int(b)}" in working


def test_format_solution_formats_numbers_without_trailing_zero() -> None:
    assert format_solution(MathProblem("q", "x\n#### 12", 12.0)).endswith("<SOLUTION>12</SOLUTION>")
    assert format_solution(MathProblem("q", "x\n#### 2.50", 2.5)).endswith("<SOLUTION>2.5</SOLUTION>")


def test_format_solution_scores_max_against_its_problem() -> None:
    problems = [NATALIA, *generate_problems(200, ArithmeticSpec(max_steps=4, seed=11))]
    results = score_completions(
        [format_solution(p) for p in problems],
        [p.answer for p in problems],
        [p.question for p in problems],
        [p.steps for p in problems],
    )
    with_steps = 0
    for problem, result in zip(problems, results, strict=True):
        if relevant_steps(problem.steps, problem.answer, problem.question):
            with_steps += 1
            assert result["total"] == pytest.approx(5.25), (problem, result)
        else:
            # Without intermediate results to show, step_check is 0 by design.
            assert result["total"] == pytest.approx(4.75), (problem, result)
    assert with_steps > 50


@pytest.mark.parametrize("tokenizer", [ChatTokenizer(), None])
def test_none_template_renders_the_question_alone(tokenizer) -> None:
    assert build_messages("Q?", "none") == [{"role": "user", "content": "Q?"}]
    rendered = render_prompt(tokenizer, "Q?", "none")
    assert rendered == ("user:Q?|assistant:" if tokenizer else "User: Q?\nAssistant: ")
    assert SYSTEM_PROMPT not in rendered and "System" not in rendered
