"""Typed reading of JSON request fields for the reference engine: a value of the wrong type is refused with the
field named (`input_ids[3]: expected an integer token id, got 1.7`) instead of being converted (`"3"`, `true`,
`1.7` are not token ids), and request bodies are bounded and read with a deadline.
"""

from __future__ import annotations

import json
from typing import Any

# What the request bodies of one engine may take (bytes), from the model and the batch it serves.
JSON_BYTES_PER_TOKEN = 16  # a token id in JSON with its separator, generously
PER_REQUEST_BYTES = 64 << 10  # sampling_params, stop strings, rid
SLACK_BYTES = 1 << 20


class FieldError(ValueError):
    """A request field of the wrong type or shape; the message names the field."""


def integer(value: Any, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise FieldError(f"{field}: expected an integer, got {value!r}")
    return value


def optional_integer(value: Any, field: str) -> int | None:
    return None if value is None else integer(value, field)


def number(value: Any, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise FieldError(f"{field}: expected a number, got {value!r}")
    return float(value)


def boolean(value: Any, field: str) -> bool:
    if not isinstance(value, bool):
        raise FieldError(f"{field}: expected true or false, got {value!r}")
    return value


def string(value: Any, field: str) -> str:
    if not isinstance(value, str):
        raise FieldError(f"{field}: expected a string, got {value!r}")
    return value


def token_ids(value: Any, field: str) -> list[int]:
    """A list of token ids (integers; bounds are the scheduler's to check)."""
    if not isinstance(value, list):
        raise FieldError(f"{field}: expected a list of integer token ids, got {type(value).__name__}")
    for i, t in enumerate(value):
        if isinstance(t, bool) or not isinstance(t, int):
            raise FieldError(f"{field}[{i}]: expected an integer token id, got {t!r}")
    return value


def request_limit(max_positions: int, max_batch_size: int) -> int:
    """Bytes a /generate body can need: a full batch of prompts of the model's whole context."""
    return max_batch_size * (max_positions * JSON_BYTES_PER_TOKEN + PER_REQUEST_BYTES) + SLACK_BYTES


def weights_limit(parameters: int, tp: int) -> int:
    """Bytes an /update_weights_from_tensor body can need: every rank's entry holds the full fp32 tensors,
    base64-encoded (4/3) with torch's serialization around them."""
    return int(tp * parameters * 4 * 4 / 3 * 1.05) + SLACK_BYTES


def parse_json(data: bytes) -> Any:
    """JSON text -> value; a nesting too deep for the parser is a FieldError, not a crash."""
    try:
        return json.loads(data)
    except RecursionError:
        raise FieldError("the request body nests JSON too deeply; send flat objects and lists") from None
    except ValueError as exc:
        raise FieldError(f"the request body is not valid JSON: {exc}") from None
