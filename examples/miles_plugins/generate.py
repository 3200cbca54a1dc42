"""Example rollout plug-in: think first, then answer after a tag the plug-in writes itself.

The model writes its working out until `<end_working_out>`; the plug-in then appends `<SOLUTION>`
(its tokens are the plug-in's, masked out of the loss, log-prob 0.0) and lets the model write the
number. Use it with ``rollout.generate_fn=miles_plugins.generate:think_then_answer``.
"""

from __future__ import annotations

from dataclasses import replace

from miles_lite.rollout.generate_plugin import GenerateResult, RolloutClient
from miles_lite.rollout.prompt_spec import PromptSpec
from miles_lite.types import SamplingParams

WORK_END, SOLUTION_START = "<end_working_out>", "<SOLUTION>"


async def think_then_answer(client: RolloutClient, prompt: PromptSpec, sampling: SamplingParams) -> GenerateResult:
    budget = sampling.max_new_tokens
    first = await client.generate(prompt.prompt_ids, replace(sampling, stop=(*sampling.stop, WORK_END)))
    ids, logprobs = list(first.output_ids), list(first.output_logprobs)
    mask = [1] * len(ids)
    if first.finish_reason != "stop" or not client.decode(ids).rstrip().endswith(WORK_END):
        return GenerateResult(ids, logprobs, mask, first.finish_reason)
    tag = client.encode(SOLUTION_START)
    if len(ids) + len(tag) >= budget:
        return GenerateResult(ids, logprobs, mask, "length")
    ids += tag
    logprobs += [0.0] * len(tag)
    mask += [0] * len(tag)
    answer = await client.generate([*prompt.prompt_ids, *ids], replace(sampling, max_new_tokens=budget - len(ids)))
    ids += answer.output_ids
    logprobs += answer.output_logprobs
    mask += [1] * len(answer.output_ids)
    return GenerateResult(ids, logprobs, mask, answer.finish_reason)
