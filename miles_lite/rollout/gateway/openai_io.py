"""OpenAI chat completions on the wire: a request body checked into a `ChatRequest` (errors name the field),
and the answer as a `chat.completion` object or a stream of `chat.completion.chunk` server-sent events.

Beyond OpenAI's fields a request may carry (through the client's `extra_body`) `top_k`,
`chat_template_kwargs` (e.g. `{"enable_thinking": false}`) and `return_token_ids` (the answer then holds
`prompt_token_ids`, the ids the engine was sent, and the choice's `token_ids`, the ids it returned). Every
answer carries `session`: the session's id, turn, engine and weight version.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from miles_lite.formats.chat import Message, MessageError
from miles_lite.formats.chat.messages import ToolCall, normalize_all


class RequestError(ValueError):
    """A request body the gateway cannot run; the text names the field and the fix (HTTP 400)."""


@dataclass
class ChatRequest:
    messages: tuple[Message, ...]
    model: str = ""
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    stream: bool = False
    include_usage: bool = False
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop: tuple[str, ...] = ()
    seed: int | None = None
    logprobs: bool = False
    options: dict[str, Any] = field(default_factory=dict)
    return_token_ids: bool = False

    @property
    def parse_tools(self) -> bool:
        """Tool calls are read from the model's turn unless the request says `tool_choice: "none"`."""
        return self.tool_choice != "none"


def _number(body: Mapping[str, Any], name: str, kind: type, low: float | None = None) -> Any:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or (kind is int and not isinstance(value, int)):
        raise RequestError(f"{name} must be {'an integer' if kind is int else 'a number'}, got {value!r}")
    if low is not None and value < low:
        raise RequestError(f"{name} must be >= {low:g}, got {value!r}")
    return kind(value)


def _tools(value: Any) -> list[dict[str, Any]] | None:
    if value is None or value == []:
        return None
    if not isinstance(value, list):
        raise RequestError(f"tools must be a list of {{\"type\": \"function\", \"function\": ...}}, got {value!r:.60}")
    for i, tool in enumerate(value):
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise RequestError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}")
    return [dict(t) for t in value]


def parse_request(body: Any) -> ChatRequest:
    """A `POST .../chat/completions` body as a `ChatRequest`; RequestError names the field at fault."""
    if not isinstance(body, Mapping):
        raise RequestError("the request body must be a JSON object")
    try:
        messages = normalize_all(body.get("messages"))
    except MessageError as exc:
        raise RequestError(str(exc)) from None
    n = body.get("n", 1)
    if n not in (1, None):
        raise RequestError(f"n={n!r}: a session holds one conversation; ask for one choice (n=1)")
    fmt = body.get("response_format")
    if isinstance(fmt, Mapping) and fmt.get("type") not in (None, "text"):
        raise RequestError(f"response_format type {fmt.get('type')!r} is not supported (only text)")
    stop = body.get("stop")
    stop = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if not all(isinstance(s, str) and s for s in stop):
        raise RequestError("stop must be a string or a list of non-empty strings")
    options = body.get("chat_template_kwargs") or {}
    if not isinstance(options, Mapping):
        raise RequestError("chat_template_kwargs must be an object")
    stream_options = body.get("stream_options") or {}
    max_tokens = _number(body, "max_completion_tokens", int, 1)
    if max_tokens is None:
        max_tokens = _number(body, "max_tokens", int, 1)
    return ChatRequest(
        messages=messages, model=str(body.get("model") or ""), tools=_tools(body.get("tools")),
        tool_choice=body.get("tool_choice"), stream=bool(body.get("stream")),
        include_usage=bool(isinstance(stream_options, Mapping) and stream_options.get("include_usage")),
        max_tokens=max_tokens, temperature=_number(body, "temperature", float, 0),
        top_p=_number(body, "top_p", float, 0), top_k=_number(body, "top_k", int, -1), stop=stop,
        seed=_number(body, "seed", int), logprobs=bool(body.get("logprobs")), options=dict(options),
        return_token_ids=bool(body.get("return_token_ids")))


def with_call_ids(reply: Message) -> Message:
    """`reply` with an id for each tool call (OpenAI's `call_...`), as the client will echo it."""
    if not reply.tool_calls:
        return reply
    calls = tuple(ToolCall(c.name, c.arguments, c.id or f"call_{secrets.token_hex(8)}") for c in reply.tool_calls)
    return Message(reply.role, reply.content, reply.reasoning, calls)


def finish_reason(engine_reason: str, reply: Message) -> str:
    if engine_reason == "length":
        return "length"
    return "tool_calls" if reply.tool_calls else "stop"


def message_json(reply: Message) -> dict[str, Any]:
    out: dict[str, Any] = {"role": "assistant", "content": reply.content or (None if reply.tool_calls else "")}
    if reply.tool_calls:
        out["tool_calls"] = [c.as_openai() for c in reply.tool_calls]
    if reply.reasoning is not None:
        out["reasoning_content"] = reply.reasoning
    return out


@dataclass
class Answer:
    """One turn's answer, in either form."""

    request: ChatRequest
    reply: Message
    finish: str
    prompt_tokens: int
    output_ids: Sequence[int]
    input_ids: Sequence[int]
    logprobs: Sequence[float]
    token_texts: Sequence[str]
    session: dict[str, Any]
    id: str = field(default_factory=lambda: f"chatcmpl-{secrets.token_hex(12)}")
    created: int = field(default_factory=lambda: int(time.time()))

    def _usage(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": len(self.output_ids),
                "total_tokens": self.prompt_tokens + len(self.output_ids)}

    def _logprobs(self) -> dict[str, Any] | None:
        if not self.request.logprobs:
            return None
        return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                            for t, lp in zip(self.token_texts, self.logprobs, strict=True)]}

    def completion(self) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "message": message_json(self.reply), "logprobs": self._logprobs(),
                                  "finish_reason": self.finish}
        out: dict[str, Any] = {"id": self.id, "object": "chat.completion", "created": self.created,
                               "model": self.request.model, "choices": [choice], "usage": self._usage(),
                               "system_fingerprint": None, "session": self.session}
        if self.request.return_token_ids:
            out["prompt_token_ids"] = list(self.input_ids)
            choice["token_ids"] = list(self.output_ids)
        return out

    def _chunk(self, delta: dict[str, Any], finish: str | None = None, **extra: Any) -> str:
        chunk = {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                 "model": self.request.model, "system_fingerprint": None,
                 "choices": [{"index": 0, "delta": delta, "logprobs": extra.pop("logprobs", None),
                              "finish_reason": finish, **extra}], "session": self.session}
        return f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"

    def events(self) -> list[str]:
        """The answer as server-sent events: the role, the reasoning, the content (with its log-probs), each tool
        call, the finish reason, the usage when asked (`stream_options.include_usage`), then `[DONE]`."""
        reply = self.reply
        out = [self._chunk({"role": "assistant", "content": ""})]
        if reply.reasoning:
            out.append(self._chunk({"reasoning_content": reply.reasoning}))
        if reply.content:
            out.append(self._chunk({"content": reply.content}, logprobs=self._logprobs()))
        for i, call in enumerate(reply.tool_calls):
            out.append(self._chunk({"tool_calls": [{"index": i, **call.as_openai()}]}))
        extra = {"token_ids": list(self.output_ids)} if self.request.return_token_ids else {}
        out.append(self._chunk({}, self.finish, **extra))
        if self.request.include_usage:
            usage = {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                     "model": self.request.model, "choices": [], "usage": self._usage()}
            out.append(f"data: {json.dumps(usage)}\n\n")
        out.append("data: [DONE]\n\n")
        return out


def error_json(message: str, kind: str = "invalid_request_error", param: str | None = None) -> dict[str, Any]:
    """OpenAI's error object (what its clients raise `BadRequestError` and friends from)."""
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}
