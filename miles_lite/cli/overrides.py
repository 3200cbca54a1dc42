"""Composing the configuration from command-line overrides with every bad override named at once.

Hydra stops at the first override it cannot merge (a value of the wrong type, a key not yet set in a
free-form mapping, a config group option that does not exist). Composition is repeated without each
override that failed, so one run of the command lists every such override, each with its field and fix,
instead of one per attempt. Unknown keys are found before composing (`config.keys`).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any

from miles_lite.config.keys import override_key, unknown_key


def explain_override_error(err: Exception) -> str:
    """One line naming the field, the value given and the type the schema wants (Hydra reports only
    "Error merging override" and keeps the field in the exception it wraps)."""
    added = re.search(r"Could not override '([^']+)'", str(err))
    if added and "." in added.group(1):
        # A key the schema allows (inside a free-form mapping such as rollout.sglang_args) but not yet set.
        key = added.group(1)
        return f"{key} is not set in {key.rsplit('.', 1)[0]}; add it with +{key}=<value>"
    missing = re.search(r"Could not find '([^'/]+)/([^']+)'", str(err))
    if missing:
        group, option = missing.groups()
        known = re.search(rf"Available options in '{re.escape(group)}':\n((?:\t.*\n?)+)", str(err))
        options = ", ".join(line.strip() for line in known.group(1).splitlines()) if known else "none"
        return f"{group}={option}: no such option in conf/{group}; options: {options}"
    cause = err.__cause__
    key = getattr(cause, "full_key", None)
    if not key:
        return " ".join(str(err).split())
    wanted = "value"
    ref_type = getattr(cause, "ref_type", None)
    if dataclasses.is_dataclass(ref_type):
        wanted = str({f.name: f.type for f in dataclasses.fields(ref_type)}.get(key.rsplit(".", 1)[-1], wanted))
    return f"{key}={getattr(cause, 'value', None)!r} is not of type {wanted}; set {key}=<{wanted}>"


def failing_override(err: Exception, overrides: Sequence[str]) -> str | None:
    """The override of `overrides` that Hydra's `err` is about, or None when it names none."""
    text = str(err)
    merged = re.search(r"Error merging override (.+)$", text, re.MULTILINE)
    if merged and merged.group(1).strip() in overrides:
        return merged.group(1).strip()
    named = re.search(r"Could not override '([^']+)'", text) or re.search(r"Could not find '([^'/]+)/", text)
    keys = [named.group(1)] if named else []
    full_key = getattr(err.__cause__, "full_key", None)
    if full_key:
        keys.append(str(full_key))
    for key in keys:
        # The last override of that key (or of a section holding it) is the one Hydra applied.
        for override in reversed(overrides):
            k = override_key(override)
            if k == key or key.startswith(k + "."):
                return override
    return None


def compose_reporting_all(overrides: Sequence[str], config_dir: str | None = None,
                          config_name: str = "config") -> tuple[Any, list[str]]:
    """(the composed `MilesConfig`, []) or (None, one line per bad override: unknown keys, then values Hydra
    could not merge, all of them)."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from miles_lite.config import load_config
    from miles_lite.config.compose import ConfigFileError

    problems: list[str] = []
    remaining: list[str] = []
    for override in overrides:
        key = override_key(override)
        problem = None if not key or key == "hydra" or key.startswith("hydra.") else unknown_key(key)
        if problem:
            problems.append(problem)
        else:
            remaining.append(override)
    while True:
        try:
            cfg = load_config(remaining, config_dir, config_name)
            break
        except ConfigFileError as err:  # a configuration directory or experiment file that is not there
            return None, [*problems, str(err)]
        except (HydraException, OmegaConfBaseException) as err:
            problems.append(explain_override_error(err))
            bad = failing_override(err, remaining)
            if bad is None:
                return None, problems
            remaining.remove(bad)
    return (None, problems) if problems else (cfg, [])
