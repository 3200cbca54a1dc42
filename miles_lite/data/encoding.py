"""Text <-> token ids for one tokenizer: prompts in the chat template, prompt specs for the rollout
manager, and the tokenised SFT pairs of the warm-up."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from miles_lite.data.calculator import tool_solution_segments
from miles_lite.data.gsm8k import MathProblem
from miles_lite.data.prompts import format_solution, render_messages, render_prompt
from miles_lite.formats.chat.incremental import continuation, model_text
from miles_lite.formats.chat.messages import normalize_all
from miles_lite.types import PromptSpec, TrainBatch


def as_template_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """A record's message as chat templates take it: the `developer` role (OpenAI's name for the system turn)
    rendered as the template renders `system`."""
    return {**message, "role": "system"} if message.get("role") == "developer" else dict(message)


# Prompts kept rendered at most (the oldest goes first).
PROMPT_CACHE_SIZE = 1 << 16


class PromptEncoder:
    """Renders and tokenises prompts and targets with `tokenizer` (an HF tokenizer) and the system prompt
    `template` (`data.prompt_template`). With `tool_solutions` the SFT targets show the calculator's turns. With a
    `chat_template` (`formats.chat`, an agent run's) records render through it, as the session gateway renders
    them, and a reference response given as messages is a whole trajectory: assistant turns trained on, the
    text between them (tool results, turn markers) out of the loss, tokenised as a session tokenises it."""

    def __init__(self, tokenizer: Any, template: str = "default", tool_solutions: bool = False,
                 max_prompt_tokens: int | None = None, chat_template: Any = None,
                 raw_prompts: bool = False) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.max_prompt_tokens = max_prompt_tokens
        self.template = template
        self.tool_solutions = tool_solutions
        # `data.chat_template=false`: a record's string prompt is fed as it is.
        self.raw_prompts = raw_prompts
        eos = getattr(tokenizer, "eos_token_id", None)  # None tokenizer: plain-text prompts, no stop ids
        self.stop_token_ids: list[int] = [eos] if eos is not None else []
        self._raw_prefix: str | None = None
        # Item (a record: hashed by identity; a math problem: by value) -> its rendered prompt and ids.
        self._prompt_cache: dict[Any, tuple[str, tuple[int, ...]]] = {}

    def render(self, item: Any) -> str:
        """The prompt text the policy continues (chat template when the tokenizer has one) for a question
        string or a math problem (with `data.prompt_template`'s system prompt), or a record (its messages,
        or its prompt as the user turn; with `raw_prompts` its string prompt as it is)."""
        if isinstance(item, str) or isinstance(item, MathProblem):
            return render_prompt(self.tokenizer, item if isinstance(item, str) else item.question, self.template)
        if item.messages is None and self.raw_prompts:
            return self.raw_prefix() + item.prompt
        messages = item.messages if item.messages is not None else ({"role": "user", "content": item.prompt},)
        if self.chat_template is not None:
            return self.chat_template.render(normalize_all([as_template_message(m) for m in messages]), _tools(item),
                                             add_generation_prompt=True)
        return render_messages(self.tokenizer, [as_template_message(m) for m in messages])

    def raw_prefix(self) -> str:
        """What the tokenizer puts before a text of its own accord (a BOS token for Llama's, nothing for
        Qwen's): a raw prompt starts with it, as TRL tokenizes standard prompts with the special tokens."""
        if self._raw_prefix is None:
            tok = self.tokenizer
            plain = list(tok("x", add_special_tokens=False)["input_ids"]) if tok is not None else []
            full = list(tok("x", add_special_tokens=True)["input_ids"]) if tok is not None else []
            cut = len(full) - len(plain)
            prefix = full[:cut] if cut > 0 and full[cut:] == plain else []
            self._raw_prefix = tok.decode(prefix) if prefix else ""
        return self._raw_prefix

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def prompt_lengths(self, items: Sequence[Any]) -> list[int]:
        """The tokens of each item's rendered prompt, as `prompt_specs` would send it (tokenised in one batch)."""
        if not items:
            return []
        ids = self.tokenizer([self.render(p) for p in items], add_special_tokens=False)["input_ids"]
        return [len(x) for x in ids]

    def sft_lengths(self, items: Sequence[Any]) -> list[int]:
        """The tokens of each item's SFT warm-up sequence (prompt, reference response, end of sequence)."""
        return [len(seq) for seq in self.sft_batch(items).tokens] if items else []

    def prompt_specs(self, batch: Sequence[tuple[int, Any]]) -> list[PromptSpec]:
        """One `PromptSpec` per (index, problem): rendered, tokenised, with the reference data the rewards need."""
        specs = []
        for index, p in batch:
            text, ids = self._rendered(p)
            if self.max_prompt_tokens is not None and len(ids) > self.max_prompt_tokens:
                raise ValueError(f"problem {index}: its prompt has {len(ids)} tokens, over data.max_prompt_tokens="
                                 f"{self.max_prompt_tokens}; raise data.max_prompt_tokens or shorten the question")
            specs.append(PromptSpec(index, ids, text, p.question, p.answer, p.steps, record=p))
        return specs

    def _rendered(self, item: Any) -> tuple[str, tuple[int, ...]]:
        """`item`'s prompt text and ids, kept per item: an epoch draws every prompt again, and a chat template
        renders in about 0.5 ms a prompt (a step of 8 prompts spent 4 ms on it)."""
        try:
            return self._prompt_cache[item]
        except KeyError:
            pass
        except TypeError:  # an unhashable item: rendered each time
            text = self.render(item)
            return text, tuple(self.encode(text))
        text = self.render(item)
        rendered = self._prompt_cache[item] = (text, tuple(self.encode(text)))
        if len(self._prompt_cache) > PROMPT_CACHE_SIZE:
            self._prompt_cache.pop(next(iter(self._prompt_cache)))
        return rendered

    def sft_batch(self, problems: Sequence[MathProblem]) -> TrainBatch:
        """Tokenised (prompt, tag-format reference solution) pairs for the SFT warm-up.

        With `tool_solutions` the solutions are written as calculator calls; the calculator's replies are
        tokenised on their own (as in a rollout) and masked out of the loss.
        """
        eos = self.tokenizer.eos_token or ""
        tokens, plens, masks = [], [], []
        for p in problems:
            prompt = self.encode(self.render(p))
            if not isinstance(p, MathProblem):  # a record: its reference response (data.response_key)
                if p.response is None:
                    raise ValueError(f"{p.where}: the SFT warm-up needs a reference response; set data.response_key "
                                     "or experiment.warmup=none")
                if not isinstance(p.response, str):
                    target, mask = self._trajectory(p)
                    tokens.append(prompt + target)
                    plens.append(len(prompt))
                    masks.append(mask)
                    continue
                segments = [(p.response, True)]
            elif self.tool_solutions:
                segments = tool_solution_segments(p)
            else:
                segments = [(format_solution(p), True)]
            segments[-1] = (segments[-1][0] + eos, True)
            target: list[int] = []
            mask: list[int] = []
            for text, trained in segments:
                ids = self.encode(text)
                target += ids
                mask += [int(trained)] * len(ids)
            tokens.append(prompt + target)
            plens.append(len(prompt))
            masks.append(mask)
        batch = TrainBatch.without_rollout(tokens, plens)
        return dataclasses.replace(batch, loss_masks=masks) if self.tool_solutions or any(0 in m for m in masks) \
            else batch

    def _trajectory(self, record: Any) -> tuple[list[int], list[int]]:
        """The ids and loss mask of a response given as messages, built as a session builds them: each assistant
        turn as the text the template renders for it after its generation prompt (end-of-turn token included;
        trained), each stretch between turns as the continuation the next request appends (not trained)."""
        if self.chat_template is None:
            raise ValueError(f"{record.where}: a reference response given as messages is rendered with the agent "
                             "sessions' chat template; set rollout.agent (and rollout.chat_template)")
        prompt = normalize_all([as_template_message(m) for m in record.messages])
        response = normalize_all(list(record.response))
        tools, history, ids, mask = _tools(record), list(prompt), [], []
        for i, message in enumerate(response):
            if message.role != "assistant":
                continue
            request = [*prompt, *response[:i]]
            if ids:
                appended = self.encode(continuation(self.chat_template, history, request, tools, None, closed=True))
                ids, mask = ids + appended, mask + [0] * len(appended)
            turn = self.encode(model_text(self.chat_template, request, message, tools, None))
            ids, mask = ids + turn, mask + [1] * len(turn)
            history = [*request, message]
        return ids, mask


def _tools(record: Any) -> Any:
    """The tool schemas a chat record's prompt is rendered with: its `tools` column (OpenAI's list), or None."""
    columns = getattr(record, "columns", None) or {}
    tools = columns.get("tools")
    return tools if isinstance(tools, list) and tools else None
