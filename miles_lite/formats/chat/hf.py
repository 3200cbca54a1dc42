"""`rollout.chat_template=hf`: the checkpoint's own Jinja template, through the tokenizer's
`apply_chat_template`. Where the model's turn ends and which formats it writes are read off the template:
the end-of-turn token is the special token the template writes right after an assistant message's content,
the tool-call format the hermes one when the template speaks of ``<tool_call>``, Llama 3's JSON when it speaks
of ``"parameters"`` under the ``ipython`` header, and turns are split at ``</think>`` when it knows that tag.
Whether the template is append-only is checked at start (`check.py`); one that is not is refused."""

from __future__ import annotations

from typing import Any

from miles_lite.formats.chat.messages import Message
from miles_lite.formats.chat.templates import ChatTemplate

_SENTINEL = "\u2063miles-probe\u2063"


class HfTemplate(ChatTemplate):
    name = "hf"

    def __init__(self, tokenizer: Any) -> None:
        source = getattr(tokenizer, "chat_template", None)
        if not isinstance(source, str) or not source:
            raise ValueError("rollout.chat_template=hf: the tokenizer has no chat template; pick a project family "
                             "(qwen2.5, qwen3, llama3)")
        self.tokenizer = tokenizer
        self.tool_parser = ("hermes" if "<tool_call>" in source else
                            "llama3_json" if "ipython" in source and "parameters" in source else "none")
        self.reasoning = "</think>" in source
        probe = self.render([Message("user", "x"), Message("assistant", _SENTINEL)])
        trailer = probe.split(_SENTINEL, 1)[1] if _SENTINEL in probe else ""
        specials = sorted({*getattr(tokenizer, "all_special_tokens", ()),
                           *(t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values()
                             if getattr(t, "special", False))}, key=len, reverse=True)
        self.close = next((s for s in specials if s and trailer.startswith(s)), "")
        if not self.close:
            raise ValueError("rollout.chat_template=hf: the template writes no special token after an assistant "
                             f"message (it writes {trailer!r}), so a turn's end cannot be told; pick a project family "
                             "(qwen2.5, qwen3, llama3)")
        self.after_close = trailer[len(self.close):]
        eos = getattr(tokenizer, "eos_token", None)
        self.stop_texts = tuple(dict.fromkeys(t for t in (self.close, eos) if t))

    def render(self, messages, tools=None, add_generation_prompt=False, options=None):
        return self.tokenizer.apply_chat_template([m.as_dict() for m in messages], tools=list(tools) if tools else None,
                                                  add_generation_prompt=add_generation_prompt, tokenize=False,
                                                  **dict(options or {}))
