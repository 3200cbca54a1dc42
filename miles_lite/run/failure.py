"""How a run ends when a plug-in fails: one line for the console, the traceback in the run's log file,
nothing half-done saved.

The step that failed is not checkpointed (its groups were never trained on, or trained without their
batch being complete); a save already in flight holds a complete earlier step and is let commit. The
newest committed checkpoint stays the resume point, and the process exits with `EXIT_PLUGIN_FAILED`.
"""

from __future__ import annotations

import time
import traceback
from pathlib import Path
from typing import Any

from miles_lite.checkpoint.resume import newest_complete
from miles_lite.formats.files import append_line
from miles_lite.observability.run_log import RUN_LOG
from miles_lite.plugins import PluginFailed

# Exit status of `miles-lite train` when a plug-in failed (0 done, 2 bad input, 3 halted by a guard).
EXIT_PLUGIN_FAILED = 4


class RunEndedByPlugin(RuntimeError):
    """The run ended because a plug-in failed; the message is the one line the console shows. `run_dir`: the
    run's directory; `checkpoint`: whether a committed checkpoint is there to resume from."""

    def __init__(self, message: str, run_dir: str = "", checkpoint: bool = False) -> None:
        super().__init__(message)
        self.run_dir = run_dir
        self.checkpoint = checkpoint


def append_traceback(run_dir: Path, failure: PluginFailed) -> Path:
    """Append the failure and its traceback to the run's log file; returns the file."""
    path = run_dir / RUN_LOG
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(traceback.format_exception(failure.error))
    append_line(path, f"{time.strftime('%Y-%m-%d %H:%M:%S')} {failure} ({failure.where or 'during the run'})\n{text}")
    return path


def end_on_plugin_failure(system: Any, io: Any, summary: Any, failure: PluginFailed, start: float) -> RunEndedByPlugin:
    """Let the save in flight commit, log the traceback, write `summary.json`; the exception to raise."""
    cfg = system.cfg
    if cfg.checkpoint.dir:
        system.trainer.finalize_checkpoint()
    resume = newest_complete(cfg.checkpoint.dir) if cfg.checkpoint.dir else None
    log = append_traceback(io.run_dir, failure)
    where = failure.where or "during the run"
    summary.stopped_reason = f"plug-in failed {where}: {failure}"
    summary.plugin_failure = {"plugin": failure.plugin, "where": where, "error": f"{type(failure.error).__name__}: "
                              f"{failure.error}", "log": str(log), "resume_from": str(resume) if resume else None}
    summary.wall_seconds = time.perf_counter() - start
    io.finish(summary, quiet=True)
    point = f"the run resumes from {resume}" if resume else "no checkpoint was committed: the run starts over"
    return RunEndedByPlugin(f"plug-in failed {where}: {failure} (traceback in {log}); {point}", str(io.run_dir),
                            resume is not None)
