"""The engine client re-sends a request once when the server drops the connection it went out on without taking
it (a pooled keep-alive connection closed under it), and names the engine when a second try fails too. POST, as
`/generate` is: aiohttp itself tries idempotent methods again on a reused connection, never a POST."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest
from aiohttp import web

from miles_lite.rollout.engine import EngineError
from miles_lite.rollout.http_client import HttpEngine
from miles_lite.types import SamplingParams
from tests.unit.local_http import serve_routes


async def _serve(drops: int) -> tuple[web.AppRunner, str, list[int]]:
    seen: list[int] = []

    async def update(request: web.Request) -> web.StreamResponse:
        seen.append(1)
        if len(seen) <= drops:
            assert request.transport is not None
            request.transport.close()  # the connection goes with no answer
            await asyncio.sleep(0.05)
        return web.json_response({"success": True, "message": "ok"})

    runner, url = await serve_routes({("POST", "/update_weight_version"): update})
    return runner, url, seen


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


def test_the_second_try_goes_out_on_a_new_connection_not_another_pooled_one() -> None:
    """A server that closed its idle keep-alive connections drops every request reused on one: two pooled
    connections are stale, so a second try through the pool would meet the other one."""

    async def main() -> tuple[list[int], list[int], int]:
        served: set[int] = set()  # client ports that carried an answered request
        dropped: list[int] = []

        async def update(request: web.Request) -> web.StreamResponse:
            assert request.transport is not None
            port = request.transport.get_extra_info("peername")[1]
            if port in served:  # as closed by the server: the request goes unanswered
                dropped.append(port)
                request.transport.close()
                await asyncio.sleep(0.05)
            served.add(port)
            await asyncio.sleep(0.05)  # concurrent requests open connections of their own
            return web.json_response({"success": True, "message": "ok"})

        runner, url = await serve_routes({("POST", "/update_weight_version"): update})
        engine = HttpEngine("e0", url)
        try:
            await asyncio.gather(engine.update_weight_version("1"), engine.update_weight_version("2"))
            pooled = sorted(served)
            await engine.update_weight_version("3")
            return pooled, dropped, len(served)
        finally:
            await engine.close()
            await runner.cleanup()

    pooled, dropped, ports = asyncio.run(main())
    assert len(pooled) == 2
    assert len(dropped) == 1 and dropped[0] in pooled  # the first try went out on a pooled connection
    assert ports == 3  # the second on a new one


def _taking_then_dropping(serving: set[str]) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """A `/generate` of a stalled SGLang being ended: it takes each request (its id into `serving`) and drops the
    connection unanswered, and refuses a second try of an id it serves as SGLang does (HTTP 400)."""

    async def generate(request: web.Request) -> web.StreamResponse:
        rid = (await request.json())["rid"]
        if rid in serving:
            return web.json_response({"error": {"message": f"Duplicate request ID detected: {rid}"}}, status=400)
        serving.add(rid)
        assert request.transport is not None
        request.transport.close()
        await asyncio.sleep(0.05)
        return web.json_response({})

    return generate


def test_a_request_the_server_took_before_dropping_the_connection_fails_as_the_engines_fault() -> None:
    """A stalled or dying server that took the first try and then dropped its connection refuses the second try
    as a duplicate of the request id it still serves (SGLang: HTTP 400): that is the engine's failure, so the
    error carries no HTTP 400 the rollout manager would blame the request for."""
    from miles_lite.rollout.manager import _BAD_REQUEST

    async def main() -> str:
        serving: set[str] = set()
        generate = _taking_then_dropping(serving)
        runner, url = await serve_routes({("POST", "/generate"): generate})
        engine = HttpEngine("e0", url)
        try:
            with pytest.raises(EngineError) as caught:
                await engine.generate([1, 2, 3], SamplingParams(max_new_tokens=4), rid="r1-p0-s0-7")
            return str(caught.value)
        finally:
            await engine.close()
            await runner.cleanup()

    error = asyncio.run(main())
    assert error.startswith("e0 /generate: ServerDisconnectedError: the server dropped the connection of a request")
    assert not _BAD_REQUEST.search(error)


def test_a_rollout_whose_engine_drops_requests_it_took_finishes_on_the_other_engine() -> None:
    """The rollout manager over a real engine client whose server takes each request, drops the connection and
    refuses the retry as a duplicate (a stalled SGLang being ended), beside a healthy engine: the samples go to
    the healthy one and the rollout completes, where the refusal used to end it as a bad request."""
    from fake_rollout_engine import FakeEngine

    from miles_lite.config.schema import FaultToleranceConfig, RolloutConfig
    from miles_lite.data.gsm8k import MathProblem
    from miles_lite.rollout.fleet import EngineFleet, EngineHandle
    from miles_lite.rollout.manager import RolloutManager
    from tests.unit.local_http import ok

    async def main() -> tuple[int, dict[str, int], int]:
        serving: set[str] = set()
        generate = _taking_then_dropping(serving)
        runner, url = await serve_routes({("POST", "/generate"): generate, ("GET", "/health_generate"): ok})
        ft = FaultToleranceConfig(health_interval_s=60.0, health_timeout_s=2.0, failure_threshold=2,
                                  max_engine_restarts=0, request_retries=3)
        fleet = EngineFleet(ft, max_inflight_per_engine=8)
        dropping, healthy = HttpEngine("e0", url), FakeEngine("b", delay_s=0.001)
        await fleet.add_engine(EngineHandle(dropping), version="0")
        await fleet.add_engine(EngineHandle(healthy), version="0")
        manager = RolloutManager(fleet, RolloutConfig(group_size=4, max_new_tokens=6, request_timeout_s=5.0), ft,
                                 decode=lambda ids: " ".join(map(str, ids)), seed=7)
        try:
            prompts = [(i, [1, 2, 3 + i], MathProblem(f"q{i}", f"#### {i}", float(i), (1.0,))) for i in range(4)]
            groups = await manager.generate_groups(prompts)
            return sum(len(g.samples) for g in groups), manager.last_stats.engines_used, len(serving)
        finally:
            await fleet.close()
            await runner.cleanup()

    samples, used, dropped = asyncio.run(main())
    assert samples == 16 and used == {"b": 16}
    assert dropped >= 1  # the dropping engine took requests, and none of them ended the rollout
