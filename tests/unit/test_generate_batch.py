"""`HttpEngine(batch_generate=True)`: the `generate` calls started together go out as one batched `/generate`
(SGLang's list form), each caller gets its own answer or error, a caller that stops waiting does not disturb
the others, and calls that differ in what applies to a whole batch (a LoRA adapter) go out apart."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web

from miles_lite.rollout.http_client import HttpEngine
from miles_lite.types import SamplingParams
from tests.unit.local_http import serve_routes

SAMPLING = SamplingParams(max_new_tokens=4, temperature=1.0, top_p=1.0, top_k=-1, stop=(), stop_token_ids=(),
                          seed=None)


def _answer(ids: list[int], rid: str | None) -> dict:
    out = [ids[-1] + 1, ids[-1] + 2]
    return {"output_ids": out, "meta_info": {"id": rid, "finish_reason": {"type": "length", "length": 2},
                                             "output_token_logprobs": [[-0.5, t, None] for t in out]}}


async def _serve(bodies: list[dict], fail: bool = False, delay_s: float = 0.0) -> tuple[web.AppRunner, str]:
    async def generate(request: web.Request) -> web.Response:
        body = await request.json()
        bodies.append(body)
        await asyncio.sleep(delay_s)  # the engine's decoding time
        if fail:
            return web.Response(status=500, text="model step failed")
        ids = body["input_ids"]
        if ids and isinstance(ids[0], list):
            return web.json_response([_answer(i, r) for i, r in zip(ids, body["rid"], strict=True)])
        return web.json_response(_answer(ids, body.get("rid")))

    return await serve_routes({("POST", "/generate"): generate})


def test_calls_started_together_share_one_request_and_get_their_own_answers() -> None:
    bodies: list[dict] = []

    async def scenario() -> None:
        runner, url = await _serve(bodies)
        engine = HttpEngine("e0", url, batch_generate=True)
        try:
            gens = await asyncio.gather(*(engine.generate([i, 10 * i], SAMPLING, rid=f"r{i}") for i in range(1, 6)))
            assert [g.output_ids for g in gens] == [(10 * i + 1, 10 * i + 2) for i in range(1, 6)]
            assert all(g.output_logprobs == (-0.5, -0.5) and g.finish_reason == "length" for g in gens)
            assert engine.inflight == 0
            # One request alone goes out as it is.
            alone = await engine.generate([7], SAMPLING, rid="solo")
            assert alone.output_ids == (8, 9)
            # A LoRA adapter applies to a whole batch: calls naming different ones go out apart.
            engine.lora_name = "v2"
            plain = HttpEngine("e0", url, batch_generate=True)
            await asyncio.gather(engine.generate([1], SAMPLING), plain.generate([2], SAMPLING))
            await plain.close()
        finally:
            await engine.close()
            await runner.cleanup()

    asyncio.run(scenario())
    assert len(bodies) == 4
    batch = bodies[0]
    assert batch["input_ids"] == [[i, 10 * i] for i in range(1, 6)] and batch["rid"] == [f"r{i}" for i in range(1, 6)]
    assert len(batch["sampling_params"]) == 5 and batch["return_logprob"] is True
    assert bodies[1]["input_ids"] == [7] and bodies[1]["rid"] == "solo"
    assert {b.get("lora_path") for b in bodies[2:]} == {"v2", None}


def test_a_failed_batch_fails_each_caller_and_a_caller_that_gives_up_leaves_the_rest() -> None:
    bodies: list[dict] = []

    async def scenario() -> None:
        runner, url = await _serve(bodies, fail=True)
        engine = HttpEngine("e0", url, batch_generate=True)
        results = await asyncio.gather(*(engine.generate([i], SAMPLING) for i in range(3)), return_exceptions=True)
        assert all("HTTP 500" in str(r) for r in results)
        await engine.close()
        await runner.cleanup()
        runner, url = await _serve(bodies, delay_s=0.2)
        engine = HttpEngine("e0", url, batch_generate=True)
        impatient = asyncio.ensure_future(asyncio.wait_for(engine.generate([1], SAMPLING), 0.05))
        patient = asyncio.ensure_future(engine.generate([2], SAMPLING))
        with pytest.raises(TimeoutError):
            await impatient
        assert (await patient).output_ids == (3, 4)
        await engine.close()
        await runner.cleanup()

    asyncio.run(scenario())
    assert [len(b["input_ids"]) for b in bodies] == [3, 2]
