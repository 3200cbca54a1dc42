"""Synthetic arithmetic problem generator."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from miles_lite.data import ArithmeticSpec, generate_problems, load_gsm8k, write_dataset
from miles_lite.data.gsm8k import extract_steps, parse_final_answer

LINE_RE = re.compile(r"^(\d+)([-+*/])(\d+)=<<\1\2\3=(\d+)>>\4$")


def check_problem(problem, spec: ArithmeticSpec) -> list[str]:
    """Verify every solution line's arithmetic and bounds; return the operators used."""
    *lines, final = problem.solution.split("\n")
    assert final == f"#### {int(problem.answer)}"
    assert spec.min_steps <= len(lines) <= spec.max_steps
    ops = []
    for line, step in zip(lines, problem.steps, strict=True):
        match = LINE_RE.match(line)
        assert match, line
        a, op, b, c = int(match[1]), match[2], int(match[3]), int(match[4])
        expected = {"+": a + b, "-": a - b, "*": a * b, "/": a / b}[op]
        assert expected == c == step
        assert 0 < c <= spec.max_result
        assert spec.min_operand <= b <= spec.max_operand
        ops.append(op)
    assert problem.steps[-1] == problem.answer
    assert parse_final_answer(problem.solution) == problem.answer
    assert extract_steps(problem.solution) == problem.steps
    assert problem.question.endswith("?")
    return ops


def test_problems_are_valid_gsm8k_format() -> None:
    spec = ArithmeticSpec(ops=("+", "-", "*", "/"), seed=3)
    used = set()
    for problem in generate_problems(300, spec):
        used.update(check_problem(problem, spec))
    assert used == {"+", "-", "*", "/"}


def test_generation_is_deterministic_per_seed() -> None:
    spec = ArithmeticSpec(seed=7)
    assert generate_problems(50, spec) == generate_problems(50, spec)
    assert generate_problems(50, spec) != generate_problems(50, ArithmeticSpec(seed=8))


def test_step_count_controls_difficulty() -> None:
    for steps in (1, 2, 4):
        spec = ArithmeticSpec(min_steps=steps, max_steps=steps, seed=1)
        problems = generate_problems(40, spec)
        assert all(len(p.steps) == steps for p in problems)
        assert all(p.solution.count("<<") == steps for p in problems)
    easy = generate_problems(100, ArithmeticSpec(min_steps=1, max_steps=2))
    hard = generate_problems(100, ArithmeticSpec(min_steps=3, max_steps=5))
    assert max(len(p.steps) for p in easy) < min(len(p.steps) for p in hard)


def test_ops_and_operand_range_are_respected() -> None:
    spec = ArithmeticSpec(ops=("+",), min_operand=5, max_operand=9, max_steps=4, seed=2)
    for problem in generate_problems(50, spec):
        assert set(check_problem(problem, spec)) == {"+"}
    spec = ArithmeticSpec(ops=("/",), min_operand=2, max_operand=12, seed=2)
    for problem in generate_problems(30, spec):
        check_problem(problem, spec)


@pytest.mark.parametrize(
    "kwargs",
    [{"min_steps": 0}, {"min_steps": 3, "max_steps": 2}, {"min_operand": 0}, {"ops": ("^",)}, {"ops": ()},
     {"max_result": 5}],
)
def test_invalid_spec_is_rejected(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        ArithmeticSpec(**kwargs)


def test_impossible_spec_raises() -> None:
    with pytest.raises(ValueError, match="could not produce"):
        generate_problems(1, ArithmeticSpec(ops=("/",), min_operand=1, max_operand=1))
    with pytest.raises(ValueError, match="n must be"):
        generate_problems(-1)


def test_write_dataset_loads_back(tmp_path: Path) -> None:
    spec = ArithmeticSpec(seed=5)
    path = write_dataset(tmp_path / "train.jsonl", 20, spec)
    assert load_gsm8k(path) == generate_problems(20, spec)


def test_eval_size_zero_means_no_held_out_problems_for_either_source(tmp_path: Path) -> None:
    from miles_lite.config.schema import MilesConfig
    from miles_lite.data.problems import load_problems

    cfg = MilesConfig()
    cfg.data.synthetic.train_size, cfg.data.synthetic.eval_size = 20, 8
    train, held_out = load_problems(cfg.data, cfg.experiment.eval_size)
    assert len(train) == 20 and len(held_out) == 8
    cfg.experiment.eval_size = 0  # honoured with synthetic data too (it used to be ignored)
    train, held_out = load_problems(cfg.data, cfg.experiment.eval_size)
    assert len(train) == 20 and held_out == []
    data = write_dataset(tmp_path / "train.jsonl", 10, ArithmeticSpec(seed=3))
    cfg.data.source, cfg.data.train_path = "gsm8k", str(data)
    train, held_out = load_problems(cfg.data, cfg.experiment.eval_size)
    assert len(train) == 10 and held_out == []
