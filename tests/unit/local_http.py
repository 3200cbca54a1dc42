"""A scripted HTTP engine for tests: an aiohttp application of the given routes on a local port."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping

from aiohttp import web

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def serve_routes(routes: Mapping[tuple[str, str], Handler], port: int = 0) -> tuple[web.AppRunner, str]:
    """Serve `routes` ({(method, path): handler}) on 127.0.0.1:`port` (0: a free one); the runner (the caller
    cleans it up) and the server's URL."""
    app = web.Application()
    for (method, path), handler in routes.items():
        app.router.add_route(method, path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


async def ok(_: web.Request) -> web.Response:
    """A health route's answer."""
    return web.Response(text="ok")


async def versioned_engine(version: str, port: int = 0) -> tuple[web.AppRunner, str]:
    """An engine that is healthy and holds weights of `version` (`/health_generate`, `/model_info`)."""

    async def model_info(_: web.Request) -> web.Response:
        return web.json_response({"weight_version": version})

    return await serve_routes({("GET", "/health_generate"): ok, ("GET", "/model_info"): model_info}, port)


async def wait_until(predicate: Callable[[], bool], timeout_s: float = 20.0) -> None:
    """Poll `predicate` every 50 ms until it holds; fail after `timeout_s`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not predicate():
        assert loop.time() < deadline, "condition not reached"
        await asyncio.sleep(0.05)
