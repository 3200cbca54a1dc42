"""Configuration keys: whether a dotted key names a field of the schema, and the closest known names when not.

A typo must be reported as such ("unknown key trainer.tpp; closest known: trainer.tp, trainer.pp"), before
anything starts, including the `+key=value` form, which Hydra would otherwise add to the typed config as an
attribute nothing reads.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any

from miles_lite.config.schema import MilesConfig


def _dataclass_of(tp: Any) -> type | None:
    """The dataclass a field's type holds (through Optional / unions), or None (a dict, list, scalar, Any)."""
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return tp
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        found = [d for a in typing.get_args(tp) if (d := _dataclass_of(a)) is not None]
        return found[0] if len(found) == 1 else None
    return None


def _fields(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints.get(f.name, Any) for f in dataclasses.fields(cls)}


def all_keys(root: type = MilesConfig, prefix: str = "") -> list[str]:
    """Every dotted key of the schema (sections and leaves)."""
    out = []
    for name, tp in _fields(root).items():
        key = f"{prefix}{name}"
        out.append(key)
        sub = _dataclass_of(tp)
        if sub is not None:
            out += all_keys(sub, f"{key}.")
    return out


def override_key(override: str) -> str:
    """The dotted key of a Hydra override (`+a.b=1`, `~a.b`, `a.b@pkg=x` -> `a.b`)."""
    return override.lstrip("+~").split("=", 1)[0].split("@", 1)[0].strip()


def unknown_key(key: str, root: type = MilesConfig) -> str | None:
    """None when `key` names a schema field (or lies inside a free-form mapping), else the error line."""
    cls: type | None = root
    parts = key.split(".")
    for i, part in enumerate(parts):
        assert cls is not None
        fields = _fields(cls)
        if part not in fields:
            parent = ".".join(parts[:i])
            siblings = [f"{parent}.{n}" if parent else n for n in fields]
            close = difflib.get_close_matches(key, all_keys(root), n=3, cutoff=0.75)
            close = close or difflib.get_close_matches(".".join(parts[: i + 1]), siblings, n=3, cutoff=0.6)
            where = f"{parent} has no field {part!r}" if parent else f"there is no section {part!r}"
            hint = f"closest known: {', '.join(close)}" if close else \
                f"known {'fields of ' + parent if parent else 'sections'}: {', '.join(sorted(siblings))}"
            return f"unknown key {key} ({where}); {hint}"
        cls = _dataclass_of(fields[part])
        if cls is None:
            return None  # a leaf, or a free-form mapping (sglang_args, engine_env, ...): anything below goes
    return None


def unknown_override_keys(overrides: list[str]) -> list[str]:
    """An error line per override whose key the schema does not have (Hydra's own `hydra.*` keys aside);
    the option a config group is set to (`experiment=tiny_cpu`) is Hydra's to check."""
    problems = []
    for o in overrides:
        key = override_key(o)
        if not key or key == "hydra" or key.startswith("hydra."):
            continue
        problem = unknown_key(key)
        if problem:
            problems.append(problem)
    return problems
