"""Which run directory a start writes, and how a re-run of the same command finds an unfinished run.

A run named by `experiment.run_name` lives in `<experiment.output_dir>/<run_name>` and a later start of that
name continues it (`checkpoint.resume=auto`). A run without one gets a time-stamped name
(`<experiment.name>-YYYYmmdd-HHMMSS`); while it has not done its `experiment.steps` it is recorded as
unfinished in `<experiment.output_dir>/.unfinished/<experiment.name>-<settings>.json`, where `<settings>` is a
digest of the resolved configuration (where the run lives and how it resumes left out). A later start with
the same settings and `checkpoint.resume=auto` takes that run's name and so continues it from its newest
checkpoint; the record goes when the run finishes. A fresh run instead: `checkpoint.resume=none`, or a name
of its own (`experiment.run_name=...`). A run in use by a live process is never continued by another.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

from miles_lite.config.changes import IGNORED_FIELDS, config_tree, flatten
from miles_lite.config.schema import MilesConfig
from miles_lite.formats.files import write_atomic
from miles_lite.run.lock import RunDirInUseError, RunLock

UNFINISHED_DIR = ".unfinished"


def settings_digest(cfg: MilesConfig) -> str:
    """12 hex digits naming the configuration's settings (the fields a resume calls `ignored` left out)."""
    fields = {k: v for k, v in flatten(config_tree(cfg)).items() if k not in IGNORED_FIELDS}
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:12]


@dataclass(frozen=True)
class RunChoice:
    """The run a start writes.

    Attributes:
        name: the run's name (its directory under `experiment.output_dir`).
        continued: an unfinished run of the same settings, found by its record, is continued.
        record: the unfinished-run record of these settings (None: the run is named by `experiment.run_name`).
        note: what the start says about its choice (None: nothing to say).
    """

    name: str
    continued: bool = False
    record: Path | None = None
    note: str | None = None

    @property
    def timestamped(self) -> bool:
        return self.record is not None


def record_path(cfg: MilesConfig) -> Path:
    """Where the unfinished-run record of `cfg`'s settings lives."""
    return Path(cfg.experiment.output_dir) / UNFINISHED_DIR / f"{cfg.experiment.name}-{settings_digest(cfg)}.json"


def _recorded_name(record: Path) -> str | None:
    try:
        name = json.loads(record.read_text()).get("run")
    except (OSError, ValueError, AttributeError):
        return None
    return name if isinstance(name, str) and name and "/" not in name else None


def _in_use(run_dir: Path) -> bool:
    try:
        RunLock(run_dir).release()
    except RunDirInUseError:
        return True
    except OSError:
        return False
    return False


def choose_run(cfg: MilesConfig) -> RunChoice:
    """The run `cfg` starts or continues (see the module docstring)."""
    if cfg.experiment.run_name:
        return RunChoice(cfg.experiment.run_name)
    record = record_path(cfg)
    fresh = f"{cfg.experiment.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    name = _recorded_name(record) if record.is_file() else None
    run_dir = Path(cfg.experiment.output_dir) / name if name else None
    if name is None or run_dir is None or not run_dir.is_dir():
        return RunChoice(fresh, record=record)
    if cfg.checkpoint.resume.strip() != "auto":
        return RunChoice(fresh, record=record, note=f"starting a new run {fresh} (checkpoint.resume="
                         f"{cfg.checkpoint.resume}); the unfinished run {run_dir} of these settings stays as it is")
    if _in_use(run_dir):
        return RunChoice(fresh, record=record, note=f"the unfinished run {run_dir} of these settings is in use by "
                         f"another process; starting a new run {fresh}")
    return RunChoice(name, continued=True, record=record,
                     note=f"continuing the unfinished run {run_dir} (same settings; checkpoint.resume=none "
                          "starts a new run instead)")


def named(cfg: MilesConfig, choice: RunChoice) -> MilesConfig:
    """`cfg` with `experiment.run_name` set to the chosen name (what the run records of itself)."""
    return dataclasses.replace(cfg, experiment=dataclasses.replace(cfg.experiment, run_name=choice.name))


def mark_unfinished(choice: RunChoice) -> None:
    """Record a time-stamped run as unfinished (a re-run of its settings continues it)."""
    if choice.record is None:
        return
    choice.record.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(choice.record, json.dumps({"run": choice.name, "since": time.strftime("%Y-%m-%d %H:%M:%S")}))


def mark_finished(choice: RunChoice) -> None:
    """Drop the unfinished-run record once the run it names has done its steps."""
    if choice.record is not None and _recorded_name(choice.record) == choice.name:
        choice.record.unlink(missing_ok=True)
