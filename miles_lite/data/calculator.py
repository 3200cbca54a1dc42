"""The GSM8K calculator tool: the model writes `<calc>3*4</calc>`, the environment answers
`<result>12</result>`; and reference solutions written in that format for the SFT warm-up.

GSM8K's solutions carry the same calls as annotations (`3*4=<<3*4=12>>12`): the tool format replaces
each annotated step by a call and its result, so SFT shows exactly the turns a rollout will have.
"""

from __future__ import annotations

import ast
import operator
import re
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

from miles_lite.formats.answer import (
    CALC_END,
    CALC_START,
    RESULT_END,
    RESULT_START,
    SOLUTION_END,
    SOLUTION_START,
    WORK_END,
    WORK_START,
    contains_number,
    format_number,
    parse_number,
)

if TYPE_CHECKING:
    from miles_lite.data.gsm8k import MathProblem


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
_CALL = re.compile(re.escape(CALC_START) + r"(.*?)" + re.escape(CALC_END), re.DOTALL)
# Expressions longer than this are refused (bounds the work one reply can cost).
_MAX_EXPRESSION = 200
# One parse at a time in the process: CPython (3.11 here) keeps the AST converter's recursion depth per
# interpreter, not per thread, so two threads parsing at once can fail with "SystemError: AST constructor
# recursion depth mismatch" (CPython gh-106905); environment replies run on the plug-in pool's threads.
_PARSING = threading.Lock()


def evaluate(expression: str) -> float:
    """Value of an arithmetic expression of numbers, + - * / and parentheses; ValueError otherwise."""
    if len(expression) > _MAX_EXPRESSION:
        raise ValueError("expression too long")
    try:
        with _PARSING:
            tree = ast.parse(expression.replace(",", "").strip(), mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"not an expression: {expression!r}") from exc

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
            return float(node.value)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
            operand = value(node.operand)
            return -operand if isinstance(node.op, ast.USub) else operand
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        raise ValueError(f"unsupported element {type(node).__name__} in {expression!r}")

    try:
        return value(tree.body)
    except ZeroDivisionError as exc:
        raise ValueError("division by zero") from exc


def format_value(number: float) -> str:
    """`12.0` -> `12`, `2.5` -> `2.5`, rounded to 6 decimals."""
    rounded = round(number, 6)
    return str(int(rounded)) if rounded == int(rounded) else f"{rounded:g}"


class Calculator:
    """The built-in GSM8K tool: the model writes `<calc>3*4</calc>`, the environment answers
    `<result>12</result>` (or `<result>error</result>` for an expression it cannot evaluate)."""

    stop = (CALC_END,)

    def reply(self, turn: str, question: str) -> str | None:
        calls = _CALL.findall(turn)
        if not calls or not turn.rstrip().endswith(CALC_END):
            return None
        try:
            return f"{RESULT_START}{format_value(evaluate(calls[-1]))}{RESULT_END}"
        except (ValueError, OverflowError):
            return f"{RESULT_START}error{RESULT_END}"


_REPLY = re.compile(re.escape(RESULT_START) + r"(.*?)" + re.escape(RESULT_END), re.DOTALL)


def call_outcomes(completion: str, steps: Sequence[float]) -> tuple[int, int]:
    """(calls the calculator answered, calls whose value is one of the reference solution's intermediate
    results `steps`) in a trajectory's text: how often the model uses the tool, and uses it on the right step."""
    values = [parse_number(v) for v in _REPLY.findall(completion)]
    right = sum(1 for v in values if v is not None and contains_number(steps, v))
    return len(values), right


# An annotated step "48/2 = <<48/2=24>>24": the written expression (optional), the call, the result.
_ANNOTATED_STEP = re.compile(r"(?:[-\d.(][-\d.,+*/() ]*=\s*)?<<([^<>=]*)=[^<>]*>>[-\d.,]*")


def tool_solution_segments(problem: MathProblem) -> list[tuple[str, bool]]:
    """The SFT target in the calculator's format, as (text, trained) segments: the environment's
    replies are not trained on (they are masked out of the loss, as in a rollout)."""
    body = problem.solution
    marker = body.rfind("####")
    if marker >= 0:
        body = body[:marker]
    lines = [line.strip() for line in body.splitlines() if line.strip()]
    text = "\n".join(lines)
    calculator = Calculator()
    segments: list[tuple[str, bool]] = []
    model = WORK_START
    position = 0
    for match in _ANNOTATED_STEP.finditer(text):
        model += text[position:match.start()] + f"{CALC_START}{match.group(1)}{CALC_END}"
        segments.append((model, True))
        segments.append((calculator.reply(model, problem.question) or "", False))
        model, position = "", match.end()
    model += text[position:] + f"{WORK_END}{SOLUTION_START}{format_number(problem.answer)}{SOLUTION_END}"
    segments.append((model, True))
    return segments
