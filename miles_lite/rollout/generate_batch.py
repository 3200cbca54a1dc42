"""One HTTP request for the `/generate` calls a client starts together.

The rollout manager runs one task per sample; in a step they all reach their engine in the same turn of the
event loop. Sent one by one, each pays an HTTP round trip and a JSON encode/decode on both sides, which on a
CPU engine costs more than the tokens (for 64 samples of 12 tokens, about twice the model's time). SGLang's
`/generate` (and the reference engine's) takes a batch: `input_ids` as a list of lists, `sampling_params` and
`rid` as lists, one answer per request in order. `GenerateBatch` collects the calls made in one turn of the
loop and sends them as one batched request (calls that differ in `return_routed_experts` or `lora_path` go
in separate ones). Each caller still gets its own answer or error: per-request ids, aborts by `rid`, seeds
and stop conditions are the engine's, as before. A caller that stops waiting (a timeout) leaves the others'
request running; its answer is dropped.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

# Keys that must be equal within one batched request (they apply to all of its requests).
_SHARED = ("return_logprob", "return_routed_experts", "lora_path", "logprob_start_len")


class GenerateBatch:
    """Coalesces `/generate` payloads submitted in one turn of the event loop; `send(body)` posts one body."""

    def __init__(self, send: Callable[[dict[str, Any]], Awaitable[Any]], path: str = "/generate") -> None:
        self._send = send
        self._path = path
        self._pending: list[tuple[dict[str, Any], asyncio.Future]] = []

    async def submit(self, payload: dict[str, Any]) -> Any:
        """The engine's answer to `payload` (one request's dict), sent with the others of this turn."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._pending.append((payload, future))
        if len(self._pending) == 1:
            loop.call_soon(self._flush)  # after every task that is ready now has had its turn
        return await future

    def _flush(self) -> None:
        pending, self._pending = self._pending, []
        groups: dict[tuple, list[tuple[dict[str, Any], asyncio.Future]]] = {}
        for payload, future in pending:
            if not future.done():  # its caller stopped waiting before the request left
                groups.setdefault(tuple(repr(payload.get(k)) for k in _SHARED), []).append((payload, future))
        for group in groups.values():
            asyncio.ensure_future(self._post(group))

    async def _post(self, group: list[tuple[dict[str, Any], asyncio.Future]]) -> None:
        try:
            if len(group) == 1:
                answers = [await self._send(group[0][0])]
            else:
                body = {k: group[0][0][k] for k in _SHARED if k in group[0][0]}
                body.update(input_ids=[p["input_ids"] for p, _ in group],
                            sampling_params=[p["sampling_params"] for p, _ in group],
                            rid=[p.get("rid") for p, _ in group])
                answers = await self._send(body)
                if not isinstance(answers, list) or len(answers) != len(group):
                    raise ValueError(f"{self._path}: a batch of {len(group)} requests got "
                                     f"{len(answers) if isinstance(answers, list) else type(answers).__name__} answers")
        except BaseException as exc:  # every caller sees the failure (or the cancellation) of their request
            for _, future in group:
                if not future.done():
                    if isinstance(exc, Exception):
                        future.set_exception(exc)
                    else:
                        future.cancel()
            if not isinstance(exc, Exception):
                raise
            return
        for (_, future), answer in zip(group, answers, strict=True):
            if not future.done():
                future.set_result(answer)
