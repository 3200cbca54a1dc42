"""Chat messages as the templates and the session gateway see them: OpenAI's message objects, checked and
normalised into one frozen shape, and compared the way a session's history is compared.

A message is ``{"role", "content", ...}`` with role ``system``, ``user``, ``assistant`` or ``tool``; an
assistant message may carry ``tool_calls`` (OpenAI's ``[{"id", "type": "function", "function": {"name",
"arguments"}}]``, arguments a JSON text or an object) and ``reasoning_content`` (thinking models); a tool
message answers one call (``tool_call_id``). Content may be a string, null, or a list of text parts.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

ROLES = ("system", "user", "assistant", "tool")


class MessageError(ValueError):
    """A message the templates cannot render; the text names the message (``messages[2].content``) and the fix."""


@dataclass(frozen=True)
class ToolCall:
    """One function call of an assistant message. `arguments` holds the parsed JSON value when the text parses
    (templates render it as JSON), else the text itself."""

    name: str
    arguments: Any
    id: str = ""

    @property
    def arguments_json(self) -> str:
        """The arguments as the JSON text an OpenAI client receives."""
        return self.arguments if isinstance(self.arguments, str) else json.dumps(self.arguments, ensure_ascii=False)

    def as_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments_json}}


@dataclass(frozen=True)
class Message:
    role: str
    content: str = ""
    reasoning: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    name: str | None = None
    # Fields the request set (an assistant message echoed back without `reasoning_content` still matches).
    given: frozenset[str] = field(default=frozenset(), compare=False)

    def as_dict(self) -> dict[str, Any]:
        """The message as a plain dict (OpenAI's shape, arguments as objects where they parse): what Jinja
        templates of HF checkpoints read."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.reasoning is not None:
            out["reasoning_content"] = self.reasoning
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments}} for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out


def _content(value: Any, where: str) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for i, part in enumerate(value):
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise MessageError(f"{where}.content[{i}] must be a text part {{\"type\": \"text\", \"text\": ...}}; "
                                   "only text is supported")
            texts.append(part["text"])
        return "".join(texts)
    raise MessageError(f"{where}.content must be a string, null or a list of text parts, got {type(value).__name__}")


def parse_arguments(value: Any) -> Any:
    """Arguments as rendered: a JSON text becomes its value (objects stay text when they do not parse)."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def _tool_calls(value: Any, where: str) -> tuple[ToolCall, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise MessageError(f"{where}.tool_calls must be a list, got {type(value).__name__}")
    calls = []
    for i, call in enumerate(value):
        at = f"{where}.tool_calls[{i}]"
        if not isinstance(call, Mapping):
            raise MessageError(f"{at} must be an object, got {type(call).__name__}")
        function = call.get("function", call)
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str) or not function["name"]:
            raise MessageError(f"{at}.function.name must be a non-empty string")
        arguments = function.get("arguments", {})
        if not isinstance(arguments, str | Mapping | list):
            raise MessageError(f"{at}.function.arguments must be a JSON text or an object")
        calls.append(ToolCall(function["name"], parse_arguments(arguments), str(call.get("id") or "")))
    return tuple(calls)


def normalize(raw: Any, index: int) -> Message:
    """One request message (a dict, or an object with `model_dump`) as a `Message`; MessageError names it."""
    where = f"messages[{index}]"
    if hasattr(raw, "model_dump"):
        raw = raw.model_dump(exclude_none=True)
    if not isinstance(raw, Mapping):
        raise MessageError(f"{where} must be an object with role and content, got {type(raw).__name__}")
    role = raw.get("role")
    if role not in ROLES:
        raise MessageError(f"{where}.role={role!r} is not one of {', '.join(ROLES)}")
    given = frozenset(k for k, v in raw.items() if v is not None)
    reasoning = raw.get("reasoning_content")
    if reasoning is not None and not isinstance(reasoning, str):
        raise MessageError(f"{where}.reasoning_content must be a string")
    calls = _tool_calls(raw.get("tool_calls"), where) if role == "assistant" else ()
    if role != "assistant" and raw.get("tool_calls"):
        raise MessageError(f"{where}: only assistant messages carry tool_calls")
    tool_call_id = raw.get("tool_call_id")
    name = raw.get("name")
    return Message(role, _content(raw.get("content"), where), reasoning if role == "assistant" else None, calls,
                   str(tool_call_id) if tool_call_id is not None and role == "tool" else None,
                   str(name) if isinstance(name, str) and name else None, given)


def normalize_all(raw: Sequence[Any]) -> tuple[Message, ...]:
    if not isinstance(raw, list | tuple) or not raw:
        raise MessageError("messages must be a non-empty list of chat messages")
    return tuple(normalize(m, i) for i, m in enumerate(raw))


def _same_calls(a: Sequence[ToolCall], b: Sequence[ToolCall]) -> bool:
    return len(a) == len(b) and all(x.name == y.name and x.arguments == y.arguments for x, y in zip(a, b, strict=True))


def difference(stored: Message, sent: Message) -> str | None:
    """Why `sent` (a request's message) does not repeat `stored` (the session's), or None when it does.

    What renders is compared: role, content, tool calls (names and parsed arguments; call ids are the
    client's business) and, when the request sends it, the reasoning; a tool message's `tool_call_id` and
    an assistant message sent back without `reasoning_content` match."""
    if stored.role != sent.role:
        return f"role {sent.role!r} where the session has {stored.role!r}"
    if stored.content.strip() != sent.content.strip() if stored.role == "assistant" else stored.content != sent.content:
        return f"content {_clip(sent.content)!r} where the session has {_clip(stored.content)!r}"
    if not _same_calls(stored.tool_calls, sent.tool_calls):
        return (f"tool calls {[(c.name, c.arguments) for c in sent.tool_calls]} where the session has "
                f"{[(c.name, c.arguments) for c in stored.tool_calls]}")
    if "reasoning_content" in sent.given and (stored.reasoning or "").strip() != (sent.reasoning or "").strip():
        return (f"reasoning_content {_clip(sent.reasoning or '')!r} where the session has "
                f"{_clip(stored.reasoning or '')!r}")
    if stored.name != sent.name and stored.role != "assistant":
        return f"name {sent.name!r} where the session has {stored.name!r}"
    return None


def _clip(text: str, n: int = 60) -> str:
    return text if len(text) <= n else text[:n] + "..."
