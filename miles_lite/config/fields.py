"""Field constructors of the configuration schema: numeric ranges and string choices kept in field metadata,
where validation reads them."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any


@dataclass(frozen=True)
class Range:
    """Allowed values of a numeric field: finite, within the bounds that are set."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None

    def contains(self, value: float) -> bool:
        return (math.isfinite(value) and (self.ge is None or value >= self.ge) and (self.gt is None or value > self.gt)
                and (self.le is None or value <= self.le) and (self.lt is None or value < self.lt))

    def describe(self, kind: str = "a finite number") -> str:
        bounds = [f"{op} {b:g}" for op, b in ((">=", self.ge), (">", self.gt), ("<=", self.le), ("<", self.lt))
                  if b is not None]
        return f"{kind} " + " and ".join(bounds) if bounds else kind


def bounded(default: float | None, *, ge: float | None = None, gt: float | None = None, le: float | None = None,
            lt: float | None = None) -> Any:
    """A numeric field whose allowed range lives in its metadata, where validation reads it (`ranges`);
    None (where the type allows it) is not range-checked."""
    return field(default=default, metadata={"range": Range(ge, gt, le, lt)})


def _metadata(cfg: object, key: str, prefix: str = "") -> dict[str, Any]:
    """Dotted field name -> `metadata[key]`, for every field of `cfg` and its sub-configs that has it."""
    found: dict[str, Any] = {}
    for f in fields(cfg):  # type: ignore[arg-type]
        dotted = f"{prefix}{f.name}"
        if key in f.metadata:
            found[dotted] = f.metadata[key]
        value = getattr(cfg, f.name)
        if is_dataclass(value) and not isinstance(value, type):
            found.update(_metadata(value, key, dotted + "."))
    return found


def ranges(cfg: object) -> dict[str, Range]:
    """Dotted field name -> allowed range, for every `bounded` field of `cfg` and its sub-configs."""
    return _metadata(cfg, "range")


def one_of(default: str, *others: str) -> Any:
    """A string field allowed to hold `default` or one of `others`.

    The allowed values live in the field's metadata, where validation reads them (`choices`):
    OmegaConf 2.3 structured configs accept neither `Literal` annotations nor enums keyed by value.
    """
    return field(default=default, metadata={"choices": (default, *others)})


def choices(cfg: object) -> dict[str, tuple[str, ...]]:
    """Dotted field name -> allowed values, for every `one_of` field of `cfg` and its sub-configs."""
    return _metadata(cfg, "choices")
