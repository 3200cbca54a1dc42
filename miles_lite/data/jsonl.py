"""JSON Lines read as bytes: one value a line, every error naming the file and the line.

A line ends at a newline byte (`\\n`, with an optional `\\r` before it) and nowhere else. Decoding the whole
file and splitting it with `str.splitlines()` would also split at U+2028, U+2029, U+0085 and other
characters that JSON allows raw inside strings (`json.dumps(ensure_ascii=False)` writes them), turning valid
records into invalid halves. Each line is decoded as UTF-8 on its own, so a stray byte is reported with its
line and position instead of a traceback for the whole file. A UTF-8 byte-order mark at the start of the file
is skipped; blank lines (JSON whitespace only) are skipped.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from miles_lite.data.errors import DatasetError

_BOM = b"\xef\xbb\xbf"
_JSON_WHITESPACE = b" \t\r\n"


def decode_line(raw: bytes, where: str) -> str:
    """One line's bytes as text; DatasetError naming `where`, the byte and its position when it is not UTF-8."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        bad = raw[exc.start:exc.start + 1].hex()
        raise DatasetError(f"{where}: byte 0x{bad} at byte {exc.start + 1} of the line is not UTF-8 "
                           f"({exc.reason}); save the file as UTF-8") from None


def json_lines(path: str | Path) -> Iterator[tuple[int, Any]]:
    """(line number from 1, parsed value) of every non-blank line of the JSON Lines file `path`.

    Raises:
        DatasetError: the file cannot be read, a line is not UTF-8, or a line is not one JSON value; the
            message names the file and the line.
    """
    path = Path(path)
    try:
        handle = path.open("rb")
    except OSError as exc:
        raise DatasetError(f"{path}: cannot read the file ({exc.strerror or exc})") from None
    with handle:
        for lineno, raw in enumerate(handle, start=1):  # binary iteration splits at b"\n" only
            if lineno == 1 and raw.startswith(_BOM):
                raw = raw[len(_BOM):]
            if not raw.strip(_JSON_WHITESPACE):
                continue
            where = f"{path}: line {lineno}"
            text = decode_line(raw, where)
            try:
                yield lineno, json.loads(text)
            except json.JSONDecodeError as exc:
                raise DatasetError(f"{where}: invalid JSON ({exc.msg} at column {exc.colno}); expected one JSON "
                                   "object per line") from None


def read_text(path: str | Path) -> str:
    """A whole file as UTF-8 text (a JSON array file); DatasetError naming the line of a byte that is not UTF-8."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise DatasetError(f"{path}: cannot read the file ({exc.strerror or exc})") from None
    if data.startswith(_BOM):
        data = data[len(_BOM):]
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        lineno = data.count(b"\n", 0, exc.start) + 1
        column = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
        raise DatasetError(f"{path}: line {lineno}: byte 0x{data[exc.start:exc.start + 1].hex()} at byte {column} "
                           f"of the line is not UTF-8 ({exc.reason}); save the file as UTF-8") from None
