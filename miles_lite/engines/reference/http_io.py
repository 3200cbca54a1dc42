"""HTTP plumbing of the reference engine's server: answers in SGLang's JSON shapes, request bodies read with a
size bound and a deadline, and batched `/generate` bodies split into one request each."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import web


def json_error(message: str, status: int = 400) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)


def json_result(success: bool, message: str, **extra: Any) -> web.Response:
    return web.json_response({"success": success, "message": message, **extra}, status=200 if success else 400)


def bad_request(message: str) -> web.HTTPBadRequest:
    return web.HTTPBadRequest(text=json.dumps({"error": {"message": message}}), content_type="application/json")


def too_large(limit: int, size: int | None, what: str) -> web.HTTPRequestEntityTooLarge:
    return web.HTTPRequestEntityTooLarge(
        max_size=limit, actual_size=size or limit + 1, content_type="application/json",
        text=json.dumps({"error": {"message": f"the request body is larger than {limit} bytes, the most {what}"}}))


async def read_body(request: web.Request, limit: int, idle_timeout_s: float, what: str) -> bytes:
    """The body, refused (413) beyond `limit` bytes before reading what the headers announce, and read
    chunk by chunk with `idle_timeout_s` per chunk (a sender that stalls is dropped)."""
    if request.content_length is not None and request.content_length > limit:
        raise too_large(limit, request.content_length, what)
    chunks, size = [], 0
    while True:
        try:
            chunk = await asyncio.wait_for(request.content.readany(), idle_timeout_s)
        except TimeoutError:
            raise web.HTTPRequestTimeout(text=json.dumps({"error": {"message": (
                f"the request body stopped arriving for {idle_timeout_s:g} s")}}), content_type="application/json"
            ) from None
        if not chunk:
            return b"".join(chunks)
        size += len(chunk)
        if size > limit:
            raise too_large(limit, size, what)
        chunks.append(chunk)


def split_batch(body: dict[str, Any]) -> list[dict[str, Any]]:
    """One dict per request from a single or batched `/generate` body."""
    ids = body.get("input_ids")
    if not isinstance(ids, list) or not ids or not isinstance(ids[0], list):
        return [body]
    n = len(ids)

    def pick(key: str, i: int) -> Any:
        value = body.get(key)
        if key == "sampling_params":
            return value[i] if isinstance(value, list) else value
        return value[i] if isinstance(value, list) and len(value) == n else value

    keys = ("sampling_params", "rid", "return_logprob", "logprob_start_len", "return_routed_experts", "lora_path")
    return [{"input_ids": ids[i], "_field": f"input_ids[{i}]", **{k: pick(k, i) for k in keys}} for i in range(n)]


def record_requests(path: str, requests: list[tuple[str, list[int]]], outputs: list[dict[str, Any]]) -> None:
    """Append each finished request (rid, input ids) with its answer's output ids and finish reason to the
    JSON-lines file `path` (`--record-requests`, for tests: what the engine saw and made)."""
    with open(path, "a") as f:
        for (rid, input_ids), out in zip(requests, outputs, strict=True):
            f.write(json.dumps({"rid": rid, "input_ids": input_ids, "output_ids": out["output_ids"],
                                "finish_reason": out["meta_info"]["finish_reason"]}) + "\n")
