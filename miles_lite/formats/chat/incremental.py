"""The token-exact step of a session: what text to append to the ids a conversation already holds.

After a model turn a session holds the ids the engine saw and produced; the next request repeats that
history and appends messages (tool results, a new user turn). Since the template is append-only, the new
text is the rendered request minus the rendered history, and only that is tokenised; the model's own tokens
are never re-tokenised. The history's text ends with the template's end of the assistant turn (``close`` +
``after_close``); the ids end with what the model wrote, ``close`` included when it ended its turn itself, so
the joint is ``after_close`` (or ``close + after_close`` after a turn cut by the token budget or a stop string).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from miles_lite.formats.chat.messages import Message
from miles_lite.formats.chat.templates import ChatTemplate


class NotAppendOnly(ValueError):
    """The template renders a longer conversation with other text under the history: its ids cannot be reused."""


def continuation(template: ChatTemplate, history: Sequence[Message], request: Sequence[Message],
                 tools: Sequence[Mapping[str, Any]] | None, options: Mapping[str, Any] | None,
                 closed: bool) -> str:
    """The text to append to a session's ids for `request` (which starts with `history`, ending with the model's
    turn; `closed`: that turn ended with the template's end-of-turn token), generation prompt included.
    With no history, the whole rendered request."""
    full = template.render(request, tools, add_generation_prompt=True, options=options)
    if not history:
        return full
    before = template.render(history, tools, add_generation_prompt=False, options=options)
    if not full.startswith(before):
        at = next((i for i, (a, b) in enumerate(zip(before, full, strict=False)) if a != b), len(before))
        raise NotAppendOnly(f"the {template.name} template renders the request's history differently from the "
                            f"session's (from character {at}: {full[at:at + 40]!r} instead of {before[at:at + 40]!r})")
    joint = template.after_close if closed else template.close + template.after_close
    return joint + full[len(before):]


def model_text(template: ChatTemplate, history: Sequence[Message], message: Message,
               tools: Sequence[Mapping[str, Any]] | None, options: Mapping[str, Any] | None) -> str:
    """What the model writes for assistant `message` after `history` (end-of-turn token included): the text the
    template renders for it after the generation prompt. Raises NotAppendOnly when the template renders the
    message other than after its own generation prompt."""
    prompt = template.render(history, tools, add_generation_prompt=True, options=options)
    full = template.render([*history, message], tools, add_generation_prompt=False, options=options)
    if not full.startswith(prompt):
        raise NotAppendOnly(f"the {template.name} template renders an assistant message other than after its "
                            "generation prompt")
    text = full[len(prompt):]
    if template.after_close and text.endswith(template.after_close):
        text = text[:-len(template.after_close)]
    if not text.endswith(template.close):
        raise NotAppendOnly(f"the {template.name} template does not end an assistant message with {template.close!r}")
    return text
