"""An agent written against the `openai` client, trained by miles-lite (`rollout.agent=agents.lookup_agent:
lookup_agent`, with `examples/` on PYTHONPATH; `experiment=agent_cpu`).

It follows the lookup chain of its record (`lookup/make_data.py`): it sends the record's messages, runs every
`lookup` tool call the model makes against the record's table and sends the results back, until the model
answers without a tool call; its reward is 1.0 when the answer is the record's label (a reward of a third per
right lookup, tried as partial credit, learnt less in the same steps: +5.4 points against +13.0). It knows
nothing of miles-lite: a base URL, a key and chat completions, as against any OpenAI-compatible server.

The tool's schema is given to the model by its SFT warm-up, not by `tools=` in the request: a tiny model trained
from scratch learns the call format from its reference trajectories, and the family's tool preamble (Qwen2.5's
lists every schema in the system prompt) would be longer than the whole task. With a real model, pass
`tools=TOOLS` (the gateway renders them with the chat template, and `miles-lite check-template` covers that).
"""

from __future__ import annotations

import json
import ssl
from typing import Any

from openai import AsyncOpenAI, DefaultAsyncHttpxClient

# One TLS context for every client: each client would otherwise load the CA bundle (~30 ms of CPU), and a run
# starts an agent per sample.
TLS = ssl.create_default_context()

TOOLS = [{"type": "function", "function": {
    "name": "lookup", "description": "The value the table holds for a key.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}]
MAX_TURNS = 4


def lookup(table: dict[str, str], arguments: str) -> str:
    """The tool: the table's value of `query`, or an error text the model sees."""
    try:
        query = str(json.loads(arguments)["query"])
    except (ValueError, KeyError, TypeError):
        return "error: call lookup with {\"query\": KEY}"
    return table.get(query, "unknown")


async def lookup_agent(base_url: str, api_key: str, record: Any, sampling: dict[str, Any]) -> dict[str, Any]:
    table = record.columns["metadata"]["table"]
    messages: list[dict[str, Any]] = [dict(m) for m in record.messages]
    calls = 0
    answer = None
    async with AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0,
                           http_client=DefaultAsyncHttpxClient(verify=TLS)) as client:
        for _ in range(MAX_TURNS):
            response = await client.chat.completions.create(model="policy", messages=messages, **sampling)
            choice = response.choices[0]
            messages.append(choice.message.model_dump(exclude_none=True))
            if not choice.message.tool_calls:
                answer = (choice.message.content or "").strip() if choice.finish_reason == "stop" else None
                break
            for call in choice.message.tool_calls:
                calls += 1
                messages.append({"role": "tool", "tool_call_id": call.id,
                                 "content": lookup(table, call.function.arguments)})
    return {"reward": float(answer == record.label), "tool_calls": calls, "answer": answer}
