"""Reading a model's turn back into an assistant message: the reasoning of thinking models, and tool calls in
the two formats the shipped families write.

- *hermes* (Qwen2.5, Qwen3): ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` blocks after the
  content, one per call, separated by a newline;
- *llama3_json* (Llama 3.x): the whole turn is one JSON object ``{"name": ..., "parameters": {...}}``.

A turn is read as tool calls only when it has exactly the shape the template renders, so that the message a
client sends back renders to the text the model wrote; anything else stays content.
"""

from __future__ import annotations

import json
from typing import Any

from miles_lite.formats.chat.messages import Message, ToolCall

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
THINK_START = "<think>"
THINK_END = "</think>"


def split_reasoning(text: str) -> tuple[str | None, str]:
    """(reasoning, content) of a thinking model's turn: the text between ``<think>`` and ``</think>`` (newlines
    around it stripped) and what follows (leading newlines stripped); (None, text) without ``</think>``."""
    if THINK_END not in text:
        return None, text
    head, _, tail = text.partition(THINK_END)
    reasoning = head.split(THINK_START)[-1] if THINK_START in head else head
    return reasoning.strip("\n"), tail.lstrip("\n")


def _call(obj: Any, arguments_key: str) -> ToolCall | None:
    if not isinstance(obj, dict) or set(obj) != {"name", arguments_key} or not isinstance(obj["name"], str):
        return None
    if not obj["name"] or not isinstance(obj[arguments_key], dict):
        return None
    return ToolCall(obj["name"], obj[arguments_key])


def parse_hermes(text: str) -> tuple[str, tuple[ToolCall, ...]]:
    """(content, tool calls) of a turn in the hermes format; no calls unless every block parses and only
    newlines separate them (and nothing but whitespace follows the last)."""
    start = text.find(TOOL_CALL_START)
    if start < 0:
        return text, ()
    content, rest = text[:start], text[start:]
    calls = []
    while rest:
        if not rest.startswith(TOOL_CALL_START):
            return text, ()
        end = rest.find(TOOL_CALL_END)
        if end < 0:
            return text, ()
        body = rest[len(TOOL_CALL_START):end]
        try:
            call = _call(json.loads(body), "arguments")
        except ValueError:
            call = None
        if call is None:
            return text, ()
        calls.append(call)
        rest = rest[end + len(TOOL_CALL_END):]
        if rest.strip() == "":
            break
        if not rest.startswith("\n"):
            return text, ()
        rest = rest[1:]
    return content[:-1] if content.endswith("\n") else content, tuple(calls)


def parse_llama_json(text: str) -> tuple[str, tuple[ToolCall, ...]]:
    """(content, tool calls) of a Llama 3 turn: one call when the whole turn is ``{"name", "parameters"}``."""
    body = text.strip()
    if body.startswith("<|python_tag|>"):
        body = body[len("<|python_tag|>"):].strip()
    if body.startswith("{") and body.endswith("}"):
        try:
            obj = json.loads(body)
        except ValueError:
            obj = None
        call = _call(obj, "parameters") or _call(obj, "arguments")
        if call is not None:
            return "", (call,)
    return text.strip(), ()


TOOL_PARSERS = {"hermes": parse_hermes, "llama3_json": parse_llama_json, "none": lambda text: (text, ())}


def parse_turn(text: str, tool_parser: str, reasoning: bool) -> Message:
    """The assistant message of a model's turn `text` (its end-of-turn token left out)."""
    thought, content = split_reasoning(text) if reasoning else (None, text)
    content, calls = TOOL_PARSERS[tool_parser](content)
    return Message("assistant", content, thought, calls)
