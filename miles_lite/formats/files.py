"""Writing a run's files so that an interruption never leaves one cut short.

A whole file (`summary.json`, `curves.png`, `config.yaml`, `presample.json`, `report.html`, a rollout table)
is written under a temporary name beside its target, flushed to disk, then renamed over it: a reader, or a
process killed mid-write (a second Ctrl-C, a pre-empted node), sees the old file or the new one, never a
truncated one. A log of records (`metrics.jsonl`, `warmup.jsonl`) grows by whole lines: each line is one
`os.write` on a descriptor opened for appending, so a signal handler that raises (Python runs them between
bytecodes) cannot cut a line in half.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

# The name a file is written under until it is complete (start-up never reads these).
TMP_MARK = ".tmp-"


def temporary_name(path: str | os.PathLike[str]) -> Path:
    """A fresh name beside `path` for writing it (unique per call, so concurrent writers never share one)."""
    path = Path(path)
    return path.with_name(f"{path.name}{TMP_MARK}{uuid.uuid4().hex[:8]}")


def write_atomic(path: str | os.PathLike[str], data: bytes | str, *, encoding: str = "utf-8") -> Path:
    """Replace `path` with `data` (bytes, or text in `encoding`) in one rename; returns `path`.

    The temporary file is removed when the write fails or is interrupted, and `path` keeps its old content.
    """
    path = Path(path)
    raw = data.encode(encoding) if isinstance(data, str) else bytes(data)
    tmp = temporary_name(path)
    try:
        with open(tmp, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


class LineLog:
    """A file of records, one line each, opened for appending; every `append` writes one whole line."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Read-write for `pread`: every write still goes to the end (O_APPEND).
        self._fd: int | None = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        self._drop_cut_line()

    def _drop_cut_line(self) -> None:
        """A line cut short by a crash (no newline at the end of the file) is removed: the file holds whole
        records only, and the next one starts its own line."""
        assert self._fd is not None
        size = os.fstat(self._fd).st_size
        end = size
        while end > 0:
            start = max(0, end - (1 << 16))
            chunk = os.pread(self._fd, end - start, start)
            if end == size and chunk.endswith(b"\n"):
                return
            cut = chunk.rfind(b"\n")
            if cut >= 0:
                os.ftruncate(self._fd, start + cut + 1)
                return
            end = start
        os.ftruncate(self._fd, 0)

    def append(self, line: str) -> None:
        """Append `line` (without its newline) in one write."""
        if self._fd is None:
            raise ValueError(f"{self.path} is closed")
        data = (line.rstrip("\n") + "\n").encode("utf-8")
        written = os.write(self._fd, data)
        while written < len(data):  # a regular file takes the whole buffer; this only guards odd filesystems
            written += os.write(self._fd, data[written:])

    def close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)

    def __enter__(self) -> LineLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def append_line(path: str | os.PathLike[str], line: str) -> None:
    """Append one whole line to `path` (created if missing)."""
    with LineLog(path) as log:
        log.append(line)
