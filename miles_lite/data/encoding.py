"""Text <-> token ids for one tokenizer: prompts in the chat template, prompt specs for the rollout
manager, and the tokenised SFT pairs of the warm-up."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from miles_lite.data.calculator import tool_solution_segments
from miles_lite.data.gsm8k import MathProblem
from miles_lite.data.prompts import format_solution, render_prompt
from miles_lite.types import PromptSpec, TrainBatch


class PromptEncoder:
    """Renders and tokenises prompts and targets with `tokenizer` (an HF tokenizer) and the system prompt
    `template` (`data.prompt_template`). With `tool_solutions` the SFT targets show the calculator's turns."""

    def __init__(self, tokenizer: Any, template: str = "default", tool_solutions: bool = False,
                 max_prompt_tokens: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.max_prompt_tokens = max_prompt_tokens
        self.template = template
        self.tool_solutions = tool_solutions
        eos = getattr(tokenizer, "eos_token_id", None)  # None tokenizer: plain-text prompts, no stop ids
        self.stop_token_ids: list[int] = [eos] if eos is not None else []

    def render(self, question: str) -> str:
        """The prompt text the policy continues (chat template when the tokenizer has one)."""
        return render_prompt(self.tokenizer, question, self.template)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def prompt_specs(self, batch: Sequence[tuple[int, MathProblem]]) -> list[PromptSpec]:
        """One `PromptSpec` per (index, problem): rendered, tokenised, with the reference data the rewards need."""
        specs = []
        for index, p in batch:
            text = self.render(p.question)
            ids = self.encode(text)
            if self.max_prompt_tokens is not None and len(ids) > self.max_prompt_tokens:
                raise ValueError(f"problem {index}: its prompt has {len(ids)} tokens, over data.max_prompt_tokens="
                                 f"{self.max_prompt_tokens}; raise data.max_prompt_tokens or shorten the question")
            specs.append(PromptSpec(index, tuple(ids), text, p.question, p.answer, p.steps))
        return specs

    def sft_batch(self, problems: Sequence[MathProblem]) -> TrainBatch:
        """Tokenised (prompt, tag-format reference solution) pairs for the SFT warm-up.

        With `tool_solutions` the solutions are written as calculator calls; the calculator's replies are
        tokenised on their own (as in a rollout) and masked out of the loss.
        """
        eos = self.tokenizer.eos_token or ""
        tokens, plens, masks = [], [], []
        for p in problems:
            prompt = self.encode(self.render(p.question))
            segments = tool_solution_segments(p) if self.tool_solutions else [(format_solution(p), True)]
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
        return dataclasses.replace(batch, loss_masks=masks) if self.tool_solutions else batch
