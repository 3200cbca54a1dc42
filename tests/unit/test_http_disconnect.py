"""The engine client re-sends a request once when the server drops the connection it went out on without taking
it (a pooled keep-alive connection closed under it), and names the engine when a second try fails too. POST, as
`/generate` is: aiohttp itself tries idempotent methods again on a reused connection, never a POST."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web

from miles_lite.rollout.engine import EngineError
from miles_lite.rollout.http_client import HttpEngine


async def _serve(drops: int) -> tuple[web.AppRunner, str, list[int]]:
    seen: list[int] = []

    async def update(request: web.Request) -> web.StreamResponse:
        seen.append(1)
        if len(seen) <= drops:
            assert request.transport is not None
            request.transport.close()  # the connection goes with no answer
            await asyncio.sleep(0.05)
        return web.json_response({"success": True, "message": "ok"})

    app = web.Application()
    app.router.add_post("/update_weight_version", update)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}", seen


@pytest.mark.parametrize(("drops", "answered"), [(0, True), (1, True), (2, False)])
def test_a_dropped_connection_is_tried_once_more(drops: int, answered: bool) -> None:
    async def main() -> tuple[bool, int]:
        runner, url, seen = await _serve(drops)
        engine = HttpEngine("e0", url)
        try:
            try:
                await engine.update_weight_version("7")
                return True, len(seen)
            except EngineError as exc:
                assert "e0 /update_weight_version: ServerDisconnectedError" in str(exc)
                return False, len(seen)
        finally:
            await engine.close()
            await runner.cleanup()

    ok, requests = asyncio.run(main())
    assert ok is answered
    assert requests == min(drops + 1, 2)
