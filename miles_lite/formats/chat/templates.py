"""Chat templates written in the project, one per model family: the text of a conversation exactly as the
family's published template lays it out, and the turn read back (reasoning, tool calls).

Every template here is *append-only*: the text of a conversation up to a point where the model speaks
(``add_generation_prompt``) is a prefix of the text of any longer conversation that keeps those messages,
and the model's turn rendered back equals what it wrote. That is what lets a session reuse the token ids
the engine saw and tokenise only what a new request appends (`incremental.py`; `check.py` verifies it).
Where a published template is not append-only the family's template here departs from it, and says so:

- ``qwen2.5``: Qwen2.5's template (the default system prompt when none is given, tools in the system
  block, hermes tool calls, consecutive tool results in one user turn).
- ``qwen3``: Qwen3's template, with every assistant turn's ``<think>`` block kept as the model wrote it.
  Qwen3's published template drops the reasoning of turns before the latest user message and writes an empty
  think block only for the last turn, so a conversation's text changes under earlier turns as it grows;
  here each turn stays as it was generated (an empty block for turns without reasoning, the form
  ``enable_thinking=false`` generates). ``enable_thinking`` (default true) only shapes the generation prompt.
- ``llama3``: Llama 3.1-3.3's template (``<|begin_of_text|>``, the system header with ``Cutting Knowledge
  Date`` and ``Today Date`` (``date_string``, default "26 Jul 2024": a date that changed mid-session would
  change the first tokens), tools in the first user message unless ``tools_in_user_message`` is false, one
  JSON tool call per turn, tool results under the ``ipython`` header as JSON).
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any

from miles_lite.formats.chat.messages import Message, MessageError
from miles_lite.formats.chat.parsing import parse_turn, split_reasoning


def tojson(value: Any, indent: int | None = None) -> str:
    """Jinja's `tojson` as HF's chat templates define it (no ASCII escaping, Python's separators)."""
    return json.dumps(value, ensure_ascii=False, indent=indent)


class ChatTemplate(ABC):
    """What the gateway and the checks need of a family's template.

    `close` is the end-of-turn token the model writes to end its turn (the template writes it too), `after_close`
    what the template writes after it; `stop_texts` are every token text that ends a turn (the engines are asked
    to stop on their ids)."""

    name = ""
    close = ""
    after_close = ""
    stop_texts: tuple[str, ...] = ()
    # Tags the family's tokenizers hold as single (non-special) added tokens.
    tags: tuple[str, ...] = ()
    tool_parser = "hermes"
    reasoning = False

    @abstractmethod
    def render(self, messages: Sequence[Message], tools: Sequence[Mapping[str, Any]] | None = None,
               add_generation_prompt: bool = False, options: Mapping[str, Any] | None = None) -> str:
        """The conversation as the family's template writes it (each family implements its own)."""

    def parse(self, text: str) -> Message:
        """The assistant message of a model turn `text` (without its end-of-turn token)."""
        return parse_turn(text, self.tool_parser, self.reasoning)


_IM_START, _IM_END = "<|im_start|>", "<|im_end|>"
QWEN_DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
_QWEN_TOOLS_HEAD = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>")
_QWEN_TOOLS_TAIL = ("\n</tools>\n\nFor each function call, return a json object with function name and arguments "
                    "within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, "
                    "\"arguments\": <args-json-object>}\n</tool_call>")


def _qwen_call(name: str, arguments: Any, raw_strings: bool) -> str:
    args = arguments if raw_strings and isinstance(arguments, str) else tojson(arguments)
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


def _qwen_tool_results(messages: Sequence[Message], i: int) -> str:
    m = messages[i]
    out = "" if i > 0 and messages[i - 1].role == "tool" else f"{_IM_START}user"
    out += f"\n<tool_response>\n{m.content}\n</tool_response>"
    if i == len(messages) - 1 or messages[i + 1].role != "tool":
        out += f"{_IM_END}\n"
    return out


_QWEN_TOOL_TAGS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")


class Qwen25Template(ChatTemplate):
    name = "qwen2.5"
    close, after_close = _IM_END, "\n"
    stop_texts = (_IM_END, "<|endoftext|>")
    tags = _QWEN_TOOL_TAGS

    def render(self, messages, tools=None, add_generation_prompt=False, options=None):
        first_system = messages[0].content if messages and messages[0].role == "system" else None
        if tools:
            out = f"{_IM_START}system\n{first_system if first_system is not None else QWEN_DEFAULT_SYSTEM}\n\n"
            out += _QWEN_TOOLS_HEAD + "".join("\n" + tojson(t) for t in tools) + _QWEN_TOOLS_TAIL + f"{_IM_END}\n"
        else:
            out = f"{_IM_START}system\n{first_system if first_system is not None else QWEN_DEFAULT_SYSTEM}{_IM_END}\n"
        for i, m in enumerate(messages):
            if m.role == "user" or (m.role == "system" and i > 0) or (m.role == "assistant" and not m.tool_calls):
                out += f"{_IM_START}{m.role}\n{m.content}{_IM_END}\n"
            elif m.role == "assistant":
                out += f"{_IM_START}assistant" + (f"\n{m.content}" if m.content else "")
                out += "".join("\n" + _qwen_call(c.name, c.arguments, False) for c in m.tool_calls) + f"{_IM_END}\n"
            elif m.role == "tool":
                out += _qwen_tool_results(messages, i)
        return out + (f"{_IM_START}assistant\n" if add_generation_prompt else "")


class Qwen3Template(ChatTemplate):
    name = "qwen3"
    close, after_close = _IM_END, "\n"
    stop_texts = (_IM_END, "<|endoftext|>")
    tags = (*_QWEN_TOOL_TAGS, "<think>", "</think>")
    reasoning = True

    def render(self, messages, tools=None, add_generation_prompt=False, options=None):
        options = options or {}
        out = ""
        first_system = messages[0].content if messages and messages[0].role == "system" else None
        if tools:
            out += f"{_IM_START}system\n" + (f"{first_system}\n\n" if first_system is not None else "")
            out += _QWEN_TOOLS_HEAD + "".join("\n" + tojson(t) for t in tools) + _QWEN_TOOLS_TAIL + f"{_IM_END}\n"
        elif first_system is not None:
            out += f"{_IM_START}system\n{first_system}{_IM_END}\n"
        for i, m in enumerate(messages):
            if m.role == "user" or (m.role == "system" and i > 0):
                out += f"{_IM_START}{m.role}\n{m.content}{_IM_END}\n"
            elif m.role == "assistant":
                reasoning, content = (m.reasoning, m.content) if m.reasoning is not None else split_reasoning(m.content)
                out += (f"{_IM_START}assistant\n<think>\n{(reasoning or '').strip(chr(10))}\n</think>\n\n"
                        f"{content.lstrip(chr(10))}")
                for j, c in enumerate(m.tool_calls):
                    out += ("\n" if j > 0 or content else "") + _qwen_call(c.name, c.arguments, True)
                out += f"{_IM_END}\n"
            elif m.role == "tool":
                out += _qwen_tool_results(messages, i)
        if add_generation_prompt:
            out += f"{_IM_START}assistant\n"
            if options.get("enable_thinking", True) is False:
                out += "<think>\n\n</think>\n\n"
        return out


_BOT, _EOT, _EOM = "<|begin_of_text|>", "<|eot_id|>", "<|eom_id|>"
_LLAMA_CALL_FORMAT = ('Respond in the format {"name": function name, "parameters": dictionary of argument name and '
                      'its value}.Do not use variables.\n\n')


def _header(role: str) -> str:
    return f"<|start_header_id|>{role}<|end_header_id|>\n\n"


class Llama3Template(ChatTemplate):
    name = "llama3"
    close, after_close = _EOT, ""
    stop_texts = (_EOT, _EOM, "<|end_of_text|>")
    tool_parser = "llama3_json"

    def render(self, messages, tools=None, add_generation_prompt=False, options=None):
        options = options or {}
        in_user = options.get("tools_in_user_message", True)
        tools = list(tools) if tools else None
        rest = list(messages)
        system = ""
        if rest and rest[0].role == "system":
            system, rest = rest[0].content.strip(), rest[1:]
        out = _BOT + _header("system") + ("Environment: ipython\n" if tools is not None else "")
        date = options.get("date_string", "26 Jul 2024")
        out += f"Cutting Knowledge Date: December 2023\nToday Date: {date}\n\n"
        listing = "".join(tojson(t, indent=4) + "\n\n" for t in tools or ())
        if tools is not None and not in_user:
            out += ("You have access to the following functions. To call a function, please respond with JSON for a "
                    "function call." + _LLAMA_CALL_FORMAT + listing)
        out += system + _EOT
        if tools is not None and in_user:
            if not rest:
                raise MessageError("llama3 puts the tools in the first user message, and there is none; add one or "
                                   "pass tools_in_user_message=false")
            first, rest = rest[0], rest[1:]
            out += _header("user") + ("Given the following functions, please respond with a JSON for a function call "
                                      "with its proper arguments that best answers the given prompt.\n\n")
            out += _LLAMA_CALL_FORMAT + listing + first.content.strip() + _EOT
        for m in rest:
            if m.role == "assistant" and m.tool_calls:
                if len(m.tool_calls) != 1:
                    raise MessageError("llama3 writes one tool call per assistant turn; this message has "
                                       f"{len(m.tool_calls)}")
                call = m.tool_calls[0]
                body = f'{{"name": "{call.name}", "parameters": {tojson(call.arguments)}}}'
                out += _header("assistant") + body + _EOT
            elif m.role == "tool":
                out += _header("ipython") + tojson(m.content) + _EOT
            else:
                out += _header(m.role) + m.content.strip() + _EOT
        return out + (_header("assistant") if add_generation_prompt else "")


FAMILY_TEMPLATES: dict[str, type[ChatTemplate]] = {
    "qwen2.5": Qwen25Template, "qwen3": Qwen3Template, "llama3": Llama3Template}
