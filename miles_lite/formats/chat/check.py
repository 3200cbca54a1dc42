"""The append-only check of a chat template on a tokenizer (`miles-lite check-template`, and at start for
`rollout.chat_template=hf`).

Over generated conversations (system prompts or none, tools or none, several tool calls per turn, tool results,
reasoning for thinking families, a second user question) a session is simulated as the gateway runs it: the
first request rendered and tokenised, each model turn taken as the tokens of the text the template renders for
that assistant message, each later request extended by tokenising only the appended text. At every point where
the model speaks, the session's ids must equal a fresh tokenisation of the whole rendered conversation; each
model turn's tokens must be the tokens that conversation holds there; and the turn read back (content,
reasoning, tool calls) must render as the message it came from.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from miles_lite.formats.chat.incremental import NotAppendOnly, continuation, model_text
from miles_lite.formats.chat.messages import Message, MessageError, ToolCall
from miles_lite.formats.chat.templates import ChatTemplate

Tokenize = Callable[[str], list[int]]

_WORDS = ("the", "value", "of", "x", "is", "42", "3.5", "kiwi", "plum", "caf\u00e9", "na\u00efve", "\u6570\u5b57",
          "{", "}", "[1, 2]", '"quoted"', "a,b", "-7", "2+2=4", "<b>", "done.", "ok?", "line\nbreak", "tab\there")
_TOOLS = ("lookup", "calculator", "search", "get_weather", "run_code")


@dataclass(frozen=True)
class Conversation:
    messages: tuple[Message, ...]
    tools: tuple[Mapping[str, Any], ...] | None
    options: Mapping[str, Any]


@dataclass
class CheckReport:
    template: str
    conversations: int = 0
    model_turns: int = 0
    failures: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.failures

    def summary(self) -> str:
        verdict = "append-only" if self.passed else f"NOT append-only ({len(self.failures)} failures)"
        return (f"{self.template}: {verdict} over {self.conversations} conversations, {self.model_turns} model turns")


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words))


def _tool_schema(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {
        "name": name, "description": f"The {name} tool.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string", "description": "what to ask"},
                                                        "n": {"type": "integer"}}, "required": ["query"]}}}


def generate_conversations(template: ChatTemplate, n: int, seed: int = 0) -> list[Conversation]:
    """`n` random conversations the template's family can hold (one tool call a turn for Llama 3, reasoning only
    where the family thinks, a second user question in some)."""
    rng = random.Random(seed)
    single_call = template.tool_parser == "llama3_json"
    out = []
    for _ in range(n):
        tools = tuple(_tool_schema(t) for t in rng.sample(_TOOLS, rng.randint(1, 3))) if rng.random() < 0.7 else None
        thinking = template.reasoning and rng.random() < 0.6
        options: dict[str, Any] = {}
        if template.reasoning:
            options["enable_thinking"] = thinking
        if template.name == "llama3":
            options["tools_in_user_message"] = rng.random() < 0.7
        messages: list[Message] = []
        if rng.random() < 0.7:
            messages.append(Message("system", _text(rng, rng.randint(2, 8))))
        for _query in range(rng.choice((1, 1, 2))):
            messages.append(Message("user", _text(rng, rng.randint(1, 10))))
            for _round in range(rng.randint(0, 3) if tools else 0):
                names = [t["function"]["name"] for t in tools]
                calls = tuple(ToolCall(rng.choice(names), {"query": _text(rng, 2), "n": rng.randint(0, 99)},
                                       id=f"call_{rng.randrange(1 << 30)}")
                              for _ in range(1 if single_call else rng.randint(1, 2)))
                content = "" if single_call or rng.random() < 0.5 else _text(rng, rng.randint(1, 6))
                messages.append(Message("assistant", content, _text(rng, 5) if thinking else None, calls))
                messages += [Message("tool", _text(rng, rng.randint(1, 6)), tool_call_id=c.id) for c in calls]
            messages.append(Message("assistant", _text(rng, rng.randint(1, 12)), _text(rng, 6) if thinking else None))
        out.append(Conversation(tuple(messages), tools, options))
    return out


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def check_conversation(template: ChatTemplate, tokenize: Tokenize, conv: Conversation, label: str,
                       report: CheckReport) -> None:
    """Simulate one session over `conv`; failures join `report`."""
    ids: list[int] = []
    history: list[Message] = []
    tools, options = conv.tools, conv.options
    for j, message in enumerate(conv.messages):
        if message.role != "assistant":
            continue
        request = list(conv.messages[:j])
        where = f"{label}, before messages[{j}]"
        try:
            ids += tokenize(continuation(template, history, request, tools, options, closed=True))
            fresh = tokenize(template.render(request, tools, add_generation_prompt=True, options=options))
            if ids != fresh:
                at = _first_difference(ids, fresh)
                report.failures.append(f"{where}: the session's ids differ from a fresh tokenisation of the "
                                       f"conversation at token {at} (session {ids[at:at + 5]}, fresh "
                                       f"{fresh[at:at + 5]})")
                return
            text = model_text(template, request, message, tools, options)
            turn = tokenize(text)
            whole = tokenize(template.render([*request, message], tools, add_generation_prompt=False, options=options))
            if whole[:len(ids) + len(turn)] != ids + turn:
                report.failures.append(f"{where}: the model's turn {text!r:.60} tokenises differently on its own than "
                                       "inside the conversation")
                return
            ids += turn
            parsed = template.parse(text[:len(text) - len(template.close)])
            again = template.render([*request, parsed], tools, add_generation_prompt=False, options=options)
            if again != template.render([*request, message], tools, add_generation_prompt=False, options=options):
                report.failures.append(f"{where}: the turn read back ({parsed.content!r:.40}, "
                                       f"{[c.name for c in parsed.tool_calls]}) renders other than the message")
                return
        except (NotAppendOnly, MessageError) as exc:
            report.failures.append(f"{where}: {exc}")
            return
        history = [*request, parsed]
        report.model_turns += 1


def check_template(template: ChatTemplate, tokenize: Tokenize, conversations: int = 200, seed: int = 0
                   ) -> CheckReport:
    """The append-only check over `conversations` generated conversations (see the module docstring)."""
    report = CheckReport(template.name)
    for i, conv in enumerate(generate_conversations(template, conversations, seed)):
        report.conversations += 1
        check_conversation(template, tokenize, conv, f"conversation {i}", report)
    return report
