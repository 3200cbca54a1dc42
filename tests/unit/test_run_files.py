"""A run's files are never left cut short: whole files are replaced by a rename, logs grow by whole lines, and no
module that writes a run's artifacts writes them any other way."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from miles_lite.formats import files
from miles_lite.formats.files import LineLog, append_line, write_atomic
from miles_lite.observability.sinks import MetricsFileSink, read_metrics_file

PACKAGE = Path(__file__).resolve().parents[2] / "miles_lite"


def test_an_interrupted_replace_leaves_the_old_file_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "curves.png"
    target.write_bytes(b"old picture")

    def interrupted(src: str, dst: str) -> None:
        raise KeyboardInterrupt  # a second Ctrl-C between the write and the rename

    monkeypatch.setattr(files.os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_atomic(target, b"new picture" * 1000)
    assert target.read_bytes() == b"old picture"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["curves.png"]  # no temporary file left behind
    monkeypatch.undo()
    write_atomic(target, "new")
    assert target.read_text() == "new"


def test_a_line_cut_short_by_a_crash_is_dropped_and_records_stay_whole(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "time": 1.0}\n{"step": 2, "ti')  # killed mid-write
    sink = MetricsFileSink(tmp_path)
    sink.log(2, {"reward/mean": 0.5})
    sink.close()
    assert [r["step"] for r in read_metrics_file(tmp_path)] == [1, 2]
    assert path.read_text().endswith("\n") and len(path.read_text().splitlines()) == 2
    path.write_text('{"step": 1')  # nothing whole at all
    append_line(path, json.dumps({"step": 1}))
    assert path.read_text() == '{"step": 1}\n'


def test_every_append_is_one_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    writes: list[bytes] = []
    real = files.os.write
    monkeypatch.setattr(files.os, "write", lambda fd, data: writes.append(bytes(data)) or real(fd, data))
    with LineLog(tmp_path / "warmup.jsonl") as log:
        log.append(json.dumps({"step": 1, "loss": 2.0, "text": "x" * 10_000}))
    assert len(writes) == 1 and writes[0].endswith(b"\n")


# Modules that write a run's files (or the files of `miles-lite report` / `presample`), and the few writes that
# are not artifacts: the output-directory probe (a scratch file it removes) and the run lock (`os.open`).
WRITERS = ["run", "observability", "cli", "evaluation", "rollout/presample.py", "cluster/engine_gang.py",
           "data/gsm8k.py"]
NOT_ARTIFACTS = {"run/dir_probe.py"}
PLAIN_WRITE = re.compile(r"\.write_text\(|\.write_bytes\(|open\([^)]*[\"'](?:w|a|wb|ab|w\+|a\+)[\"']")


def test_no_run_artifact_is_written_in_place() -> None:
    found = []
    for root in WRITERS:
        paths = [PACKAGE / root] if root.endswith(".py") else sorted((PACKAGE / root).rglob("*.py"))
        for path in paths:
            rel = str(path.relative_to(PACKAGE))
            if rel in NOT_ARTIFACTS:
                continue
            for n, line in enumerate(path.read_text().splitlines(), start=1):
                if PLAIN_WRITE.search(line):
                    found.append(f"{rel}:{n}: {line.strip()}")
    assert not found, "write run files with formats.files (write_atomic / LineLog):\n" + "\n".join(found)
