"""Engine flags given as pass-through mappings (`rollout.sglang_args`, `rollout.reference_args`).

A key may spell its flag with underscores or with dashes (`mem_fraction_static`, `mem-fraction-static`), as
both become the same command-line flag; whatever reads a flag from such a mapping reads it in either spelling.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def flag_name(key: object) -> str:
    """The flag a key spells, with underscores (`mem-fraction-static` -> `mem_fraction_static`)."""
    return str(key).replace("-", "_")


def flag_keys(args: Mapping[str, Any], flag: str) -> list[str]:
    """The keys of `args` that spell `flag`, in order."""
    return [k for k in args if flag_name(k) == flag]


def flag_value(args: Mapping[str, Any], flag: str, default: Any = None) -> Any:
    """The value `args` gives `flag` in either spelling (the last key spelling it wins); `default` when unset."""
    keys = flag_keys(args, flag)
    return args[keys[-1]] if keys else default


def by_flag_name(args: Mapping[str, Any]) -> dict[str, Any]:
    """Flag name (underscores) -> value, whichever spelling each key uses."""
    return {flag_name(k): v for k, v in args.items()}
