"""Turning a config string into one of an algorithm's enum choices, with an error listing them."""

from __future__ import annotations

from enum import StrEnum
from typing import TypeVar

E = TypeVar("E", bound=StrEnum)


def parse_choice(enum_cls: type[E], value: E | str, name: str) -> E:
    """`enum_cls(value)`, or a ValueError naming the argument `name` and every allowed value."""
    try:
        return enum_cls(value)
    except ValueError:
        choices = [e.value for e in enum_cls]
        raise ValueError(f"{name}={value!r} is not supported; choose one of {choices}") from None
