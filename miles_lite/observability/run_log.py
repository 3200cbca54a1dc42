"""The run's own log: what the project's modules log while a run lasts, with times, in `logs/run.log` (where a
failing plug-in's traceback and a lost node's verdict are written too).

`miles-lite` configures no logging of its own otherwise, and Python drops records below WARNING where nothing is
configured: the hand-off's plan, the start-up's stages and a dead engine's diagnosis would be lost. For the run's
duration `RunLog` sends the `miles_lite` loggers' INFO and above to the run's file (timestamped, one line each) and,
where the process configured no logging of its own, their warnings to stderr as before (the bare message: Python's
last resort stops once a handler is found); then it takes its handlers away.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from types import TracebackType

# The run's log, under its directory.
RUN_LOG = Path("logs") / "run.log"
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class RunLog:
    """A context manager over one run (see the module docstring); `path` is its file."""

    def __init__(self, run_dir: Path, name: str = "miles_lite") -> None:
        self.path = Path(run_dir) / RUN_LOG
        self.logger = logging.getLogger(name)
        self._handlers: list[logging.Handler] = []
        self._level = self.logger.level

    def __enter__(self) -> RunLog:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        to_file = logging.FileHandler(self.path, encoding="utf-8")
        to_file.setLevel(logging.INFO)
        to_file.setFormatter(logging.Formatter(FORMAT))
        self._handlers = [to_file]
        if not logging.getLogger().handlers:  # else the process's own handlers show the warnings (once)
            to_console = logging.StreamHandler(sys.stderr)
            to_console.setLevel(logging.WARNING)
            to_console.setFormatter(logging.Formatter("%(message)s"))
            self._handlers.append(to_console)
        for handler in self._handlers:
            self.logger.addHandler(handler)
        if self.logger.level == logging.NOTSET or self.logger.level > logging.INFO:
            self.logger.setLevel(logging.INFO)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        for handler in self._handlers:
            self.logger.removeHandler(handler)
            handler.close()
        self._handlers = []
        self.logger.setLevel(self._level)
