"""Which run a start writes: a named run is itself; a time-stamped one is recorded as unfinished under its
settings, and a later start with the same settings continues it (unless it asks for a fresh run, or the run is
in use); the record goes when the run finishes."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from miles_lite.config.schema import MilesConfig
from miles_lite.run.lock import RunLock
from miles_lite.run.naming import UNFINISHED_DIR, choose_run, mark_finished, mark_unfinished, named


def _cfg(tmp_path: Path, **experiment) -> MilesConfig:
    cfg = MilesConfig()
    cfg.experiment.output_dir = str(tmp_path)
    for key, value in experiment.items():
        setattr(cfg.experiment, key, value)
    return cfg


def test_a_named_run_is_itself_and_records_nothing(tmp_path: Path) -> None:
    choice = choose_run(_cfg(tmp_path, run_name="mine"))
    assert choice.name == "mine" and not choice.continued and choice.record is None
    mark_unfinished(choice)
    assert not (tmp_path / UNFINISHED_DIR).exists()


def test_a_rerun_of_the_same_settings_continues_the_unfinished_run(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    first = choose_run(cfg)
    assert first.name.startswith("tiny_cpu-") and not first.continued
    (tmp_path / first.name).mkdir()
    mark_unfinished(first)
    assert first.record is not None and first.record.parent == tmp_path / UNFINISHED_DIR
    again = choose_run(cfg)
    assert again.continued and again.name == first.name and "continuing the unfinished run" in again.note
    # What the run records of itself names it, and that changes nothing of its settings.
    assert choose_run(named(cfg, again)).name == first.name
    assert choose_run(dataclasses.replace(cfg, experiment=dataclasses.replace(cfg.experiment, run_name=None)))\
        .continued
    # Other settings: another run.
    other = MilesConfig()
    other.experiment.output_dir, other.trainer.lr = str(tmp_path), 1.0
    assert not choose_run(other).continued
    # A fresh run on request; the unfinished one stays.
    fresh_cfg = _cfg(tmp_path)
    fresh_cfg.checkpoint.resume = "none"
    fresh = choose_run(fresh_cfg)
    assert not fresh.continued and fresh.note is not None
    assert "checkpoint.resume=none" in fresh.note and "stays as it is" in fresh.note
    # A run in use by a live process is not continued by another.
    with RunLock(tmp_path / first.name):
        busy = choose_run(cfg)
    assert not busy.continued and "in use by another process" in busy.note
    mark_finished(again)
    assert not first.record.exists() and not choose_run(cfg).continued


def test_a_record_naming_a_missing_run_starts_a_new_one(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    first = choose_run(cfg)
    mark_unfinished(first)  # its directory never came to be
    assert not choose_run(cfg).continued
