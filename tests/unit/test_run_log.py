"""The run's own log (`observability/run_log.py`): the project's INFO records reach `logs/run.log` with their times
while the run lasts, warnings still reach stderr as bare messages (once, where the process logs on its own), and
nothing stays attached after."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from miles_lite.observability.run_log import RunLog


def plain_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """The root logger as in a `miles-lite` process: no handler (pytest adds its own for each test's call)."""
    monkeypatch.setattr(logging.getLogger(), "handlers", [])


def test_info_goes_to_the_run_file_and_warnings_to_stderr_while_the_run_lasts(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    plain_process(monkeypatch)
    log = logging.getLogger("miles_lite.run.handoff")
    root = logging.getLogger("miles_lite")
    before = (list(root.handlers), root.level)
    log.info("dropped: no run yet")
    with RunLog(tmp_path) as run_log:
        log.info("hand-off plan %s", "kept")
        log.debug("too fine")
        log.warning("an engine died")
    log.info("dropped again")
    lines = run_log.path.read_text().splitlines()
    assert run_log.path == tmp_path / "logs" / "run.log"
    assert len(lines) == 2
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO miles_lite.run.handoff: hand-off plan kept",
                        lines[0])
    assert lines[1].endswith("WARNING miles_lite.run.handoff: an engine died")
    assert capsys.readouterr().err == "an engine died\n"
    assert (list(root.handlers), root.level) == before


def test_a_process_logging_on_its_own_shows_each_warning_once(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    plain_process(monkeypatch)
    own = logging.StreamHandler(sys.stderr)
    logging.getLogger().addHandler(own)
    try:
        with RunLog(tmp_path) as run_log:
            logging.getLogger("miles_lite.rollout.fleet").warning("an engine died")
    finally:
        logging.getLogger().removeHandler(own)
    assert capsys.readouterr().err == "an engine died\n"
    assert run_log.path.read_text().count("an engine died") == 1
