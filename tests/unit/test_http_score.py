"""`HttpEngine.score` against a server answering as SGLang does, including its relabelling of the last id.

SGLang (0.5.10 through 0.5.23, `_process_input_token_logprobs`) reports every input id >= vocab_size - 1 as 0
in `input_token_logprobs`. The client accepts that for the model's last id only, and still returns the
entry's log-prob; every other mismatch is an error.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import pytest
from aiohttp import web

from miles_lite.config.schema import FaultToleranceConfig, RolloutConfig
from miles_lite.engines.fleet_launch import attach_fleet
from miles_lite.engines.launcher import served_vocab_size
from miles_lite.rollout.engine import EngineError
from miles_lite.rollout.http_client import HttpEngine, reported_input_id
from tests.unit.local_http import ok, serve_routes

VOCAB = 512


def _logprob(position: int, token: int) -> float:
    """A value that names its position and token, so a shifted or swapped entry shows."""
    return -(position + 1) - token / 1000.0


def sglang_ids(ids: list[int], vocab_size: int) -> list[int]:
    """SGLang's expression, verbatim in effect: `x if x < vocab_size - 1 else 0`."""
    return [x if x < vocab_size - 1 else 0 for x in ids]


Relabel = Callable[[list[int]], list[int]]


async def _serve(relabel: Relabel, drop_value_at: int | None = None) -> web.AppRunner:
    async def generate(request: web.Request) -> web.Response:
        body = await request.json()
        ids, start = body["input_ids"], body["logprob_start_len"]
        values: list[float | None] = [None] + [_logprob(i, ids[i]) for i in range(start + 1, len(ids))]
        if drop_value_at is not None:
            values[drop_value_at] = None
        entries = [[v, t, None] for v, t in zip(values, relabel(ids[start:]), strict=True)]
        return web.json_response({"output_ids": [1], "meta_info": {"input_token_logprobs": entries}})

    runner, _ = await serve_routes({("POST", "/generate"): generate, ("GET", "/health_generate"): ok})
    return runner


def _score(relabel: Relabel, tokens: list[int], prompt_len: int, vocab_size: int | None,
           drop_value_at: int | None = None) -> list[float]:
    async def scenario() -> list[float]:
        runner = await _serve(relabel, drop_value_at)
        engine = HttpEngine("sglang-0", f"http://127.0.0.1:{runner.addresses[0][1]}", vocab_size=vocab_size)
        try:
            return await engine.score(tokens, prompt_len)
        finally:
            await engine.close()
            await runner.cleanup()

    return asyncio.run(scenario())


TOKENS = [3, 4, VOCAB - 1, 7, VOCAB - 1, 0, VOCAB - 2]


def test_the_last_id_reported_as_zero_is_accepted_and_its_value_kept() -> None:
    scores = _score(lambda ids: sglang_ids(ids, VOCAB), TOKENS, 2, VOCAB)
    assert scores == [_logprob(i, TOKENS[i]) for i in range(2, len(TOKENS))]


def test_ids_reported_as_sent_are_accepted_too() -> None:
    # The reference engine reports every id as it is.
    assert _score(lambda ids: ids, TOKENS, 2, VOCAB) == [_logprob(i, TOKENS[i]) for i in range(2, len(TOKENS))]


def test_without_the_vocab_size_the_relabelled_id_is_refused_with_the_fix() -> None:
    with pytest.raises(EngineError, match=r"does not match token 511 \(SGLang reports the model's last id as 0"):
        _score(lambda ids: sglang_ids(ids, VOCAB), TOKENS, 2, None)


@pytest.mark.parametrize("relabel, match", [
    # Zero for an id that is not the last one (here VOCAB - 2): a real mismatch.
    (lambda ids: sglang_ids(ids, VOCAB - 1), "does not match token 510"),
    # An engine serving a smaller vocabulary clips at its own last id: 510 is not this model's last id.
    (lambda ids: [0 if x == VOCAB - 2 else x for x in ids], "does not match token 510"),
    # The last id reported as something other than itself or 0.
    (lambda ids: [5 if x == VOCAB - 1 else x for x in ids], r"entry \[-3.511, 5\] does not match token 511"),
    # A zero token reported as the last id (the relabelling never goes that way).
    (lambda ids: [VOCAB - 1 if x == 0 else x for x in ids], "does not match token 0"),
])
def test_any_other_mismatch_is_an_error(relabel: Relabel, match: str) -> None:
    with pytest.raises(EngineError, match=match):
        _score(relabel, TOKENS, 2, VOCAB)


def test_a_relabelled_entry_without_a_logprob_is_an_error() -> None:
    # Answer entry 1 is position 2 of TOKENS (entry 0 is the prompt's last token): id 511, reported as 0.
    with pytest.raises(EngineError, match=r"entry \[None, 0\] does not match token 511"):
        _score(lambda ids: sglang_ids(ids, VOCAB), TOKENS, 2, VOCAB, drop_value_at=1)


def test_reported_input_id() -> None:
    assert reported_input_id(VOCAB - 1, VOCAB) == 0
    assert reported_input_id(VOCAB - 2, VOCAB) == VOCAB - 2
    assert reported_input_id(0, VOCAB) == 0
    assert reported_input_id(VOCAB - 1, None) == VOCAB - 1
    with pytest.raises(ValueError, match="vocab_size must be >= 1"):
        HttpEngine("e", "http://127.0.0.1:1", vocab_size=0)


def test_served_vocab_size_reads_config_json(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 151936}))
    assert served_vocab_size(str(tmp_path)) == 151936
    # A multimodal config: the text model's vocabulary, as SGLang reads it.
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 9, "text_config": {"vocab_size": 32000}}))
    assert served_vocab_size(str(tmp_path)) == 32000
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    assert served_vocab_size(str(tmp_path)) is None
    assert served_vocab_size(str(tmp_path / "missing")) is None


def test_attached_engines_get_the_vocab_size() -> None:
    async def scenario() -> None:
        runner = await _serve(lambda ids: sglang_ids(ids, VOCAB))
        fleet = await attach_fleet(RolloutConfig(startup_timeout_s=20.0), FaultToleranceConfig(),
                                   [f"http://127.0.0.1:{runner.addresses[0][1]}"], health_checks=False,
                                   vocab_size=VOCAB)
        try:
            (record,) = fleet.records
            engine = record.handle.engine
            assert engine.vocab_size == VOCAB
            assert await engine.score(TOKENS, 2) == [_logprob(i, TOKENS[i]) for i in range(2, len(TOKENS))]
        finally:
            await fleet.close()
            await runner.cleanup()

    asyncio.run(scenario())
