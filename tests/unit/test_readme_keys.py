"""The README's tables name real configuration keys, and every key of the run's own sections (`experiment.*`,
`checkpoint.*`) is in one of them."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from miles_lite.config.keys import unknown_key
from miles_lite.config.schema import GROUPS, CheckpointConfig, ExperimentConfig

README = Path(__file__).resolve().parents[2] / "README.md"
KEY = re.compile(r"`\+?((?:" + "|".join(GROUPS) + r")\.[A-Za-z_][\w.]*)")


def table_keys() -> set[str]:
    """The dotted keys in backticks on the README's table rows (a `<placeholder>` ends a key)."""
    rows = [line for line in README.read_text().splitlines() if line.startswith("|")]
    return {m.group(1).rstrip(".") for row in rows for m in KEY.finditer(row)}


def test_every_key_in_the_readme_tables_exists() -> None:
    wrong = {key: problem for key in sorted(table_keys()) if (problem := unknown_key(key))}
    assert not wrong, wrong


def test_every_run_setting_is_in_a_readme_table() -> None:
    keys = table_keys()
    wanted = [f"experiment.{f.name}" for f in dataclasses.fields(ExperimentConfig)]
    wanted += [f"checkpoint.{f.name}" for f in dataclasses.fields(CheckpointConfig)]
    missing = [key for key in wanted if key not in keys]
    assert not missing, f"README.md has no table row for {missing}"
