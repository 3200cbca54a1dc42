"""Agents the tests run as `rollout.agent` plug-ins, written against the `openai` client."""

from __future__ import annotations

import json
import time

import openai

TABLE = {"kiwi": "plum", "plum": "7", "fig": "3"}


async def tool_agent(base_url, api_key, record, sampling):
    """Look keys up until the model answers; reward 1.0 for the right answer. The record's metadata may ask for a
    blocking tool (`slow_s`), an exception (`fail`) or a hang (`hang_s`)."""
    meta = record.columns.get("metadata") or {}
    if meta.get("fail"):
        raise RuntimeError("the agent broke")
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [dict(m) for m in record.messages]
    started = time.monotonic()
    turns = 0
    async with client:
        for _ in range(6):
            resp = await client.chat.completions.create(model="policy", messages=messages, **sampling)
            turns += 1
            message = resp.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                break
            for call in message.tool_calls:
                if meta.get("slow_s"):
                    time.sleep(meta["slow_s"])  # a blocking tool: stalls this agent's own thread only
                if meta.get("hang_s"):
                    time.sleep(meta["hang_s"])
                key = json.loads(call.function.arguments)["key"]
                messages.append({"role": "tool", "tool_call_id": call.id, "content": TABLE.get(key, "?")})
    answer = (messages[-1].get("content") or "").removeprefix("The answer is ").rstrip(".")
    return {"reward": float(answer == record.label), "turns_used": turns, "seconds": time.monotonic() - started}


ABORTS: list[tuple[str, str]] = []


def note_abort(base_url, api_key, record, reason):
    ABORTS.append((record.columns.get("metadata", {}).get("name", ""), reason))


def no_request_agent(base_url, api_key, record, sampling):
    return {"reward": 1.0}


class StatefulTool:
    """An environment with per-trajectory state (its `reset`), which worker processes could not keep."""

    stop = ("</t>",)

    def reset(self, record):
        return StatefulTool()

    def reply(self, turn, question):
        return None
