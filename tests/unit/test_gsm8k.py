"""GSM8K parsing, loading and saving."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from miles_lite.data import DatasetError, MathProblem, load_gsm8k, save_gsm8k
from miles_lite.data.gsm8k import extract_steps, parse_final_answer

NATALIA_Q = (
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?"
)
NATALIA_A = (
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
    "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n"
    "#### 72"
)


def write_jsonl(path: Path, records: list[dict | str]) -> Path:
    lines = [r if isinstance(r, str) else json.dumps(r) for r in records]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.mark.parametrize(
    ("text", "expected"),
    [("so 72\n#### 72", 72.0), ("#### 1,234", 1234.0), ("#### -3", -3.0), ("#### 2.50", 2.5),
     ("x\n####   8  \n", 8.0), ("<SOLUTION>5</SOLUTION>\n#### 9", 9.0)],
)
def test_parse_final_answer(text: str, expected: float) -> None:
    assert parse_final_answer(text) == expected


def test_parse_final_answer_errors_name_the_problem() -> None:
    with pytest.raises(ValueError, match=r"^problem 3 has no '#### N' final answer; GSM8K answers end"):
        parse_final_answer("the answer is 72", where="problem 3")
    with pytest.raises(ValueError, match="'\\$72'.*not a number"):
        parse_final_answer("#### $72")


def test_extract_steps_reads_annotation_results() -> None:
    assert extract_steps(NATALIA_A) == (24.0, 72.0)
    assert extract_steps("a <<10*.5=5>> b <<oops>> c <<2*3=x>> d <<1,000+1=1,001>>") == (5.0, 1001.0)


def test_math_problem_from_record() -> None:
    problem = MathProblem.from_record(NATALIA_Q, NATALIA_A)
    assert problem.answer == 72.0
    assert problem.steps == (24.0, 72.0)
    assert problem.solution == NATALIA_A


def test_load_jsonl_skips_blank_lines_and_extra_fields(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "train.jsonl", [
        {"question": NATALIA_Q, "answer": NATALIA_A, "id": 1}, "", {"question": "1+1?", "answer": "#### 2"},
    ])
    problems = load_gsm8k(path)
    assert [p.answer for p in problems] == [72.0, 2.0]
    assert problems[0].question == NATALIA_Q


def test_load_json_array(tmp_path: Path) -> None:
    path = tmp_path / "train.json"
    path.write_text(json.dumps([{"question": NATALIA_Q, "answer": NATALIA_A}]), encoding="utf-8")
    assert load_gsm8k(path)[0].answer == 72.0


def test_load_parquet(tmp_path: Path) -> None:
    path = tmp_path / "train.parquet"
    pq.write_table(pa.table({"question": [NATALIA_Q, "1+1?"], "answer": [NATALIA_A, "#### 2"]}), path)
    problems = load_gsm8k(path)
    assert [p.answer for p in problems] == [72.0, 2.0]
    assert problems[0].steps == (24.0, 72.0)


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet"])
def test_save_then_load_roundtrips(tmp_path: Path, suffix: str) -> None:
    problems = [MathProblem.from_record(NATALIA_Q, NATALIA_A), MathProblem.from_record("q?", "x\n#### 1,234")]
    path = save_gsm8k(problems, tmp_path / "sub" / f"out{suffix}")
    assert load_gsm8k(path) == problems


def test_bad_line_error_names_file_line_field_and_fix(tmp_path: Path) -> None:
    records = [{"question": NATALIA_Q, "answer": NATALIA_A}] * 6 + [{"question": "q", "answer": "it is 5"}]
    path = write_jsonl(tmp_path / "bad.jsonl", records)
    with pytest.raises(DatasetError) as info:
        load_gsm8k(path)
    message = str(info.value)
    assert str(path) in message
    assert "line 7: field 'answer' has no '#### N' final answer" in message
    assert "GSM8K answers end with '#### <number>'" in message


def test_missing_field_and_invalid_json_errors(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "a.jsonl", [{"question": "q", "solution": "#### 1"}])
    expected = r"line 1: missing field 'answer'.*found fields: \['question', 'solution'\]"
    with pytest.raises(DatasetError, match=expected):
        load_gsm8k(path)
    path = write_jsonl(tmp_path / "b.jsonl", [{"question": "q", "answer": "#### 1"}, "{not json"])
    with pytest.raises(DatasetError, match="line 2: invalid JSON"):
        load_gsm8k(path)
    path = write_jsonl(tmp_path / "c.jsonl", [{"question": 3, "answer": "#### 1"}])
    with pytest.raises(DatasetError, match="line 1: field 'question' must be a non-empty string"):
        load_gsm8k(path)


def test_parquet_errors_name_row_and_columns(tmp_path: Path) -> None:
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"question": ["q", "q"], "answer": ["#### 1", "none"]}), path)
    with pytest.raises(DatasetError, match=r"row 1 \(0-based\): field 'answer' has no '#### N'"):
        load_gsm8k(path)
    pq.write_table(pa.table({"prompt": ["q"]}), path)
    with pytest.raises(DatasetError, match=r"lacks column\(s\) \['question', 'answer'\]; found \['prompt'\]"):
        load_gsm8k(path)


def test_unknown_extension_and_missing_file(tmp_path: Path) -> None:
    expected = r"unsupported dataset extension '\.csv'; supported: \.jsonl, \.json, \.parquet"
    with pytest.raises(DatasetError, match=expected):
        load_gsm8k(tmp_path / "x.csv")
    with pytest.raises(DatasetError, match="supported"):
        save_gsm8k([], tmp_path / "x.txt")
    with pytest.raises(DatasetError, match="not found"):
        load_gsm8k(tmp_path / "missing.jsonl")


def test_save_rejects_solution_that_disagrees_with_answer(tmp_path: Path) -> None:
    problem = MathProblem(question="q", solution="#### 5", answer=6.0)
    with pytest.raises(DatasetError, match="problem 0 .*'#### 5' but answer is 6"):
        save_gsm8k([problem], tmp_path / "x.jsonl")
