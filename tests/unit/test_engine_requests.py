"""The reference engine's HTTP server against hostile or careless requests, in-process on a tiny random model:
deeply nested JSON and fields of the wrong type answer 400 naming the field, bodies beyond what a request can
need answer 413 without being read, and idle or half-sent connections are closed after the idle timeout."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import AsyncIterator, Iterator

import pytest
from aiohttp import ClientSession, web

from miles_lite.engines.reference.engine import make_runner
from miles_lite.engines.reference.server import ReferenceServer, ServerOptions

IDLE_S = 0.5  # the idle test's timeout
# The other tests' timeout: long enough that a loaded machine stalling the client between two chunks of a request
# does not end the connection under the test.
BUSY_IDLE_S = 30.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=128, tie_word_embeddings=True, max_position_embeddings=64)
    path = str(tmp_path_factory.mktemp("tiny"))
    Qwen2ForCausalLM(config).save_pretrained(path, safe_serialization=True)
    return path


class Served:
    """A ReferenceServer on a free local port, run by the engine's own runner."""

    def __init__(self, server: ReferenceServer, runner: web.AppRunner, port: int) -> None:
        self.server, self.runner, self.port = server, runner, port
        self.url = f"http://127.0.0.1:{port}"


async def _serve(model_dir: str, idle_timeout_s: float = BUSY_IDLE_S, **opts: object) -> Served:
    server = ReferenceServer(ServerOptions(model_path=model_dir, max_batch_size=4, idle_timeout_s=idle_timeout_s,
                                           **opts))  # type: ignore[arg-type]
    runner = make_runner(server)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return Served(server, runner, runner.addresses[0][1])


def scenario(model_dir: str, body, **opts: object) -> None:
    async def main() -> None:
        served = await _serve(model_dir, **opts)
        try:
            await body(served)
        finally:
            await served.runner.cleanup()

    asyncio.run(main())


async def post(served: Served, path: str, data: bytes | str) -> tuple[int, str]:
    async with ClientSession() as session, session.post(
            served.url + path, data=data, headers={"Content-Type": "application/json"}) as resp:
        return resp.status, await resp.text()


def error(text: str) -> str:
    return json.loads(text)["error"]["message"]


def test_nested_json_and_wrong_types_answer_400_naming_the_field(model_dir: str):
    async def body(served: Served) -> None:
        status, text = await post(served, "/generate", '{"input_ids": ' + "[" * 100_000 + "]" * 100_000 + "}")
        assert status == 400 and "nests JSON too deeply" in error(text), (status, text[:200])
        for bad, shown in ((1.7, "1.7"), ("3", "'3'"), (True, "True")):
            status, text = await post(served, "/generate", json.dumps({"input_ids": [1, bad, 2]}))
            assert status == 400 and error(text) == f"input_ids[1]: expected an integer token id, got {shown}"
        status, text = await post(served, "/generate", json.dumps({"input_ids": [[1, 2], ["x"]]}))
        assert status == 400 and error(text).startswith("input_ids[1][0]: expected an integer token id")
        status, text = await post(served, "/generate", json.dumps({"input_ids": "1 2 3"}))
        assert status == 400 and error(text).startswith("input_ids: expected a list of integer token ids")
        for params, field in (({"max_new_tokens": "3"}, "sampling_params.max_new_tokens"),
                              ({"temperature": True}, "sampling_params.temperature"),
                              ({"stop_token_ids": [1.5]}, "sampling_params.stop_token_ids[0]"),
                              ({"ignore_eos": "no"}, "sampling_params.ignore_eos")):
            status, text = await post(served, "/generate", json.dumps({"input_ids": [1], "sampling_params": params}))
            assert status == 400 and error(text).startswith(f"{field}: expected"), (params, text)
        status, text = await post(served, "/generate", json.dumps({"input_ids": [1], "logprob_start_len": "0"}))
        assert status == 400 and error(text).startswith("logprob_start_len: expected an integer")
        # The engine serves on, and right requests still work.
        status, text = await post(served, "/generate", json.dumps(
            {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2, "temperature": 0}}))
        assert status == 200 and len(json.loads(text)["output_ids"]) == 2, text

    scenario(model_dir, body)


def test_request_bodies_are_bounded_by_what_a_request_needs(model_dir: str):
    async def body(served: Served) -> None:
        # Derived: a full batch (4) of the model's whole context (64 tokens), far below the old 1 GiB.
        assert served.server.request_limit < 2 << 20
        assert served.server.weights_limit > served.server.request_limit
        # Announced beyond the limit: refused from the headers, before a byte of the body is read.
        reader, writer = await asyncio.open_connection("127.0.0.1", served.port)
        writer.write(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 629145600\r\n\r\n")
        await writer.drain()
        started = time.monotonic()
        status_line = await asyncio.wait_for(reader.readline(), 10)
        assert status_line.startswith(b"HTTP/1.1 413"), status_line
        assert time.monotonic() - started < 5
        writer.close()
        # Configured smaller: a body just over it is refused, also when sent chunked (no Content-Length).
        status, text = await post(served, "/generate", json.dumps({"input_ids": [1] * 3000}))
        assert status == 413 and "larger than 4096 bytes" in error(text), (status, text)

        async def chunks() -> AsyncIterator[bytes]:
            yield b'{"input_ids": ['
            for _ in range(2000):
                yield b"1, "
            yield b"1]}"

        async with ClientSession() as session, session.post(served.url + "/generate", data=chunks()) as resp:
            assert resp.status == 413
        status, _ = await post(served, "/generate", json.dumps({"input_ids": [1, 2],
                                                                "sampling_params": {"max_new_tokens": 1}}))
        assert status == 200

    scenario(model_dir, body, max_request_bytes=4096)


def _closed_within(sock: socket.socket, timeout_s: float) -> bytes:
    """Read until the server closes the connection; fail after `timeout_s`."""
    sock.settimeout(timeout_s)
    data = b""
    while True:
        chunk = sock.recv(4096)
        if not chunk:
            return data
        data += chunk


@pytest.fixture
def port_of(model_dir: str) -> Iterator[int]:
    import threading

    loop = asyncio.new_event_loop()
    ready: list[Served] = []
    started = threading.Event()

    def run() -> None:
        asyncio.set_event_loop(loop)
        ready.append(loop.run_until_complete(_serve(model_dir, idle_timeout_s=IDLE_S)))
        started.set()
        loop.run_forever()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert started.wait(120)
    try:
        yield ready[0].port
    finally:
        asyncio.run_coroutine_threadsafe(ready[0].runner.cleanup(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


@pytest.mark.parametrize("sent", [b"", b"POST /generate HTTP/1.1\r\nHost: x\r\n",
                                  b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"input"])
def test_idle_and_half_sent_connections_are_closed(port_of: int, sent: bytes):
    # Nothing, half the headers, or half the body, then silence: the server drops the connection.
    with socket.create_connection(("127.0.0.1", port_of)) as sock:
        sock.sendall(sent)
        started = time.monotonic()
        answer = _closed_within(sock, 20 * IDLE_S)
        assert time.monotonic() - started < 20 * IDLE_S
        assert answer == b"" or answer.startswith(b"HTTP/1.1 408"), answer[:100]
