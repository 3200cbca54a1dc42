"""The files a records path names, and their rows: one reader per format behind `read_rows`.

A path (`data.train_path`, `data.eval_path`, an evaluation set's `path`) is a file, a `datasets`
`save_to_disk` folder, a glob (`shards/train-*.parquet`), or a list of any of these, read in that order
(a glob's matches sorted). Formats, by extension:

- `.jsonl`, and `.json` holding JSON Lines (what `Dataset.to_json` writes) or one JSON array of records;
- `.parquet` (`Dataset.to_parquet`, the Hub's shards);
- `.arrow` (Arrow IPC, stream or file: `datasets`' own files) and `save_to_disk` folders (their `state.json`
  lists the `.arrow` files).

Each row comes with where it is, for messages: `<file>: line N` for JSON (1-based, as editors count),
`<file>: row N (0-based)` for Parquet and Arrow. JSON Lines are read as bytes, a line at a time (`data.jsonl`).
"""

from __future__ import annotations

import glob
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from miles_lite.data.errors import DatasetError
from miles_lite.data.jsonl import json_lines, read_text

EXTENSIONS = (".jsonl", ".json", ".parquet", ".arrow")
_GLOB_CHARS = ("*", "?", "[")
DATASET_STATE = "state.json"
DATASET_DICT = "dataset_dict.json"


def _expand_one(entry: str, field: str) -> list[Path]:
    if any(c in entry for c in _GLOB_CHARS):
        matches = sorted(Path(m) for m in glob.glob(entry, recursive=True))
        files = [m for m in matches if m.is_file() or (m / DATASET_STATE).is_file()]
        if not files:
            raise DatasetError(f"{field}={entry!r}: the pattern matches no records file")
        return files
    return [Path(entry)]


def record_paths(spec: Any, field: str = "data.train_path") -> list[Path]:
    """The files and folders `spec` names (a path, a glob, or a list of them), each checked to exist and to
    be of a known format.

    Raises:
        DatasetError: naming `field`, for nothing named, a missing file, an unknown extension, a folder that
            is not a `save_to_disk` folder (a `DatasetDict`'s root names its splits).
    """
    entries = list(spec) if isinstance(spec, list | tuple) else [spec]
    if not entries or any(not isinstance(e, str | Path) or not str(e).strip() for e in entries):
        raise DatasetError(f"{field}={spec!r}: give a records file, a datasets save_to_disk folder, a glob, or a list "
                           "of them")
    paths = [p for entry in entries for p in _expand_one(str(entry), field)]
    for path in paths:
        _check(path)
    return paths


def _check(path: Path) -> None:
    if path.is_dir():
        if (path / DATASET_STATE).is_file():
            return
        if (path / DATASET_DICT).is_file():
            splits = json.loads((path / DATASET_DICT).read_text(encoding="utf-8")).get("splits", [])
            named = ", ".join(str(path / s) for s in splits) or "a split folder"
            raise DatasetError(f"{path}: a datasets DatasetDict folder; name one of its splits: {named}")
        raise DatasetError(f"{path}: a folder that is not a datasets save_to_disk folder (no {DATASET_STATE}); name "
                           f"its files, or a glob such as {path}/*.parquet")
    if path.suffix.lower() not in EXTENSIONS:
        raise DatasetError(f"{path}: unsupported records file extension {path.suffix!r}; use "
                           f"{', '.join(EXTENSIONS)} or a datasets save_to_disk folder")
    if not path.is_file():
        raise DatasetError(f"{path}: records file not found")


def data_files(path: Path) -> list[Path]:
    """The files holding `path`'s rows: itself, or a `save_to_disk` folder's `.arrow` files."""
    if not path.is_dir():
        return [path]
    state = json.loads((path / DATASET_STATE).read_text(encoding="utf-8"))
    files = [path / f["filename"] for f in state.get("_data_files", [])]
    missing = [f for f in files if not f.is_file()]
    if missing or not files:
        raise DatasetError(f"{path}: its {DATASET_STATE} lists data files {[f.name for f in files]}, "
                           f"{'missing: ' + str([f.name for f in missing]) if missing else 'none'}")
    return files


def _json_array(path: Path, text: str, start: int) -> Iterator[tuple[str, Any]]:
    decoder = json.JSONDecoder()
    i = start + 1
    while True:
        while i < len(text) and text[i].isspace():
            i += 1
        if i < len(text) and text[i] == "]":
            return
        where = f"{path}: line {text.count(chr(10), 0, i) + 1}"
        try:
            row, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError as exc:
            raise DatasetError(f"{where}: invalid JSON ({exc.msg}) in the array of records") from None
        yield where, row
        while i < len(text) and text[i].isspace():
            i += 1
        if i < len(text) and text[i] == ",":
            i += 1
        elif i >= len(text) or text[i] != "]":
            raise DatasetError(f"{path}: line {text.count(chr(10), 0, i) + 1}: expected ',' or ']' between the "
                               "array's records")


def _json(path: Path) -> Iterator[tuple[str, Any]]:
    if path.suffix.lower() == ".json":
        head = _first_bytes(path).lstrip(b"\xef\xbb\xbf \t\r\n")[:1]
        if head == b"[":
            text = read_text(path)
            yield from _json_array(path, text, text.index("["))
            return
        if head == b"{":
            text = read_text(path)
            if "\n" in text.strip():
                try:
                    whole = json.loads(text)
                except ValueError:  # JSON Lines (or broken: the line reader says where)
                    whole = None
                if isinstance(whole, dict):
                    raise DatasetError(f"{path}: holds one JSON object written over several lines; a records file "
                                       "holds one record per line (JSON Lines, as Dataset.to_json writes) or one JSON "
                                       "array")
    for lineno, row in json_lines(path):
        yield f"{path}: line {lineno}", row


def _first_bytes(path: Path, n: int = 64) -> bytes:
    try:
        with path.open("rb") as f:
            return f.read(n)
    except OSError as exc:
        raise DatasetError(f"{path}: cannot read the file ({exc.strerror or exc})") from None


def _table_rows(path: Path, table: Any) -> Iterator[tuple[str, Any]]:
    for index, row in enumerate(table.to_pylist()):
        yield f"{path}: row {index} (0-based)", row


def read_parquet(path: Path) -> Any:
    """The Parquet file's table; DatasetError naming the file when it cannot be read."""
    import pyarrow.parquet as pq

    try:
        return pq.read_table(path)
    except Exception as exc:  # pyarrow raises several types for corrupt files
        raise DatasetError(f"{path}: cannot read Parquet file: {exc}") from None


def _parquet(path: Path) -> Iterator[tuple[str, Any]]:
    yield from _table_rows(path, read_parquet(path))


def _arrow(path: Path) -> Iterator[tuple[str, Any]]:
    import pyarrow as pa

    errors = []
    for open_reader in (pa.ipc.open_stream, pa.ipc.open_file):  # datasets writes the stream format
        try:
            with pa.memory_map(str(path)) as source:
                table = open_reader(source).read_all()
            break
        except Exception as exc:  # not this layout, or corrupt
            errors.append(str(exc))
    else:
        raise DatasetError(f"{path}: cannot read Arrow file: {errors[-1]}")
    yield from _table_rows(path, table)


READERS = {".jsonl": _json, ".json": _json, ".parquet": _parquet, ".arrow": _arrow}


def read_rows(path: Path) -> Iterator[tuple[str, Any]]:
    """Every row of one file or `save_to_disk` folder, with where it is."""
    for file in data_files(path):
        yield from READERS[file.suffix.lower()](file)
