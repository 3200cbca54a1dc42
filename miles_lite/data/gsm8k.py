"""GSM8K-format math problems: parsing, loading and saving.

A GSM8K record has a ``question`` and an ``answer`` field. The ``answer`` field is the
reference solution: free text whose calculator annotations look like ``<<48/2=24>>`` and whose
last line is ``#### <final number>``. This module turns records into :class:`MathProblem`
values and back, from JSON-lines (``.jsonl``/``.json``) or Parquet files.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from miles_lite.data.errors import DatasetError
from miles_lite.data.jsonl import json_lines, read_text
from miles_lite.data.record_files import read_parquet
from miles_lite.formats.answer import numbers_equal, parse_final_answer, parse_number
from miles_lite.formats.files import write_atomic

SUPPORTED_SUFFIXES = (".jsonl", ".json", ".parquet")
_ANNOTATION_RE = re.compile(r"<<([^<>]*)>>")


@dataclass(frozen=True)
class MathProblem:
    """One math word problem with its reference solution.

    Attributes:
        question: the problem statement shown to the model.
        solution: the reference solution text (the GSM8K ``answer`` field), ending with
            ``#### <number>``.
        answer: the final numeric answer, read from the ``####`` line.
        steps: intermediate results, one per ``<<expr=value>>`` annotation in ``solution``,
            in order (the value after the last ``=``).
    """

    question: str
    solution: str
    answer: float
    steps: tuple[float, ...] = ()
    # "<file>: line N" (or row, item): where the problem came from, for error messages; "" when generated.
    where: str = field(default="", compare=False)

    # The attributes of a record (`data.records.Record`): a math problem is a record whose prompt is the
    # question, whose label is the final number, and whose columns are GSM8K's `question` and `answer`.
    @property
    def prompt(self) -> str:
        return self.question

    @property
    def messages(self) -> None:
        return None

    @property
    def label(self) -> float:
        return self.answer

    @property
    def source(self) -> None:
        return None

    @property
    def response(self) -> None:
        return None

    @property
    def columns(self) -> dict[str, str]:
        return {"question": self.question, "answer": self.solution}

    @classmethod
    def from_record(cls, question: str, solution: str, *, where: str = "problem") -> MathProblem:
        """Build a problem from a GSM8K ``question``/``answer`` pair; ``where`` names it in errors."""
        return cls(
            question=question,
            solution=solution,
            answer=parse_final_answer(solution, where=where),
            steps=extract_steps(solution),
        )


def extract_steps(text: str) -> tuple[float, ...]:
    """Intermediate results from ``<<expr=value>>`` annotations, in order of appearance.

    An annotation without ``=`` or whose value is not a number is skipped: the public GSM8K
    data holds a handful of malformed annotations, and steps are auxiliary information that
    should not make a whole dataset unloadable.
    """
    steps = []
    for body in _ANNOTATION_RE.findall(text):
        if "=" not in body:
            continue
        value = parse_number(body.rsplit("=", 1)[1])
        if value is not None:
            steps.append(value)
    return tuple(steps)


def strip_annotations(text: str) -> str:
    """Remove ``<<...>>`` calculator annotations, keeping the surrounding math text."""
    return _ANNOTATION_RE.sub("", text)


def _check_suffix(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix not in SUPPORTED_SUFFIXES:
        raise DatasetError(
            f"{path}: unsupported dataset extension {path.suffix!r}; supported: "
            f"{', '.join(SUPPORTED_SUFFIXES)}"
        )
    return suffix


def _record_to_problem(record: Any, where: str) -> MathProblem:
    if not isinstance(record, dict):
        raise DatasetError(
            f"{where}: expected a JSON object with 'question' and 'answer' fields, "
            f"got {type(record).__name__}"
        )
    for name in ("question", "answer"):
        value = record.get(name)
        if name not in record:
            raise DatasetError(
                f"{where}: missing field {name!r}; each record needs 'question' and 'answer' "
                f"(found fields: {sorted(record)})"
            )
        if not isinstance(value, str) or not value.strip():
            raise DatasetError(f"{where}: field {name!r} must be a non-empty string, got {value!r}")
    try:
        problem = MathProblem.from_record(record["question"], record["answer"], where=f"{where}: field 'answer'")
    except ValueError as exc:
        raise DatasetError(str(exc)) from None
    return replace(problem, where=where)


def _is_json_array(path: Path) -> bool:
    """Whether a `.json` file holds one JSON array (its first non-blank byte is `[`) rather than JSON lines."""
    with path.open("rb") as f:
        head = f.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
    return head.startswith(b"[")


def _iter_json_records(path: Path) -> Iterator[tuple[str, Any]]:
    if path.suffix.lower() == ".json" and _is_json_array(path):
        # A .json file may also be a single JSON array of records.
        try:
            records = json.loads(read_text(path))
        except json.JSONDecodeError as exc:
            raise DatasetError(f"{path}: invalid JSON array: {exc}") from None
        for index, record in enumerate(records):
            yield f"{path}: item {index} (0-based)", record
        return
    for lineno, record in json_lines(path):
        yield f"{path}: line {lineno}", record


def _iter_parquet_records(path: Path) -> Iterator[tuple[str, Any]]:
    table = read_parquet(path)
    missing = [name for name in ("question", "answer") if name not in table.column_names]
    if missing:
        raise DatasetError(
            f"{path}: Parquet file lacks column(s) {missing}; found {table.column_names}; "
            "GSM8K data needs string columns 'question' and 'answer'"
        )
    columns = table.select(["question", "answer"]).to_pydict()
    for index, (question, answer) in enumerate(zip(columns["question"], columns["answer"], strict=True)):
        yield f"{path}: row {index} (0-based)", {"question": question, "answer": answer}


def load_gsm8k(path: str | Path) -> list[MathProblem]:
    """Load GSM8K-format problems from a ``.jsonl``/``.json`` or ``.parquet`` file.

    Each record needs string fields ``question`` and ``answer`` (the reference solution ending
    in ``#### <number>``); other fields are ignored. Blank lines in JSON-lines files are
    skipped.

    Raises:
        DatasetError: (a ``ValueError``) for a missing file, an unknown extension, or a
            malformed record; the message names the file, the line or row, the field and the fix.
    """
    path = Path(path)
    suffix = _check_suffix(path)
    if not path.is_file():
        raise DatasetError(f"{path}: dataset file not found")
    records = _iter_parquet_records(path) if suffix == ".parquet" else _iter_json_records(path)
    problems = [_record_to_problem(record, where) for where, record in records]
    if not problems:
        raise DatasetError(f"{path}: dataset holds no records")
    return problems


def save_gsm8k(problems: Iterable[MathProblem], path: str | Path) -> Path:
    """Write problems as GSM8K ``question``/``answer`` records to ``.jsonl``/``.json`` or ``.parquet``.

    ``.json`` is written as JSON lines, which :func:`load_gsm8k` reads back. Parent directories
    are created. Returns the path written.

    Raises:
        DatasetError: unknown extension, or a problem whose ``solution`` does not end with a
            ``#### N`` line equal to its ``answer`` (it would not load back).
    """
    path = Path(path)
    suffix = _check_suffix(path)
    records = []
    for index, problem in enumerate(problems):
        where = f"problem {index} (0-based)"
        try:
            written = parse_final_answer(problem.solution, where=f"{where}: solution")
        except ValueError as exc:
            raise DatasetError(str(exc)) from None
        if not numbers_equal(written, problem.answer):
            raise DatasetError(
                f"{where}: solution says '#### {written:g}' but answer is {problem.answer:g}; "
                "the saved file keeps only the solution text, so they must agree"
            )
        records.append({"question": problem.question, "answer": problem.solution})
    path.parent.mkdir(parents=True, exist_ok=True)
    if suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        schema = pa.schema([("question", pa.string()), ("answer", pa.string())])
        buffer = pa.BufferOutputStream()
        pq.write_table(pa.Table.from_pylist(records, schema=schema), buffer)
        write_atomic(path, buffer.getvalue().to_pybytes())  # an interrupted save leaves no half a file
    else:
        write_atomic(path, "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records))
    return path
