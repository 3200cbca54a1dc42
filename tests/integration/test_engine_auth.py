"""The reference engine behind the run's API key: every endpoint but `/health` answers 401 without the key or
with a wrong one (and does nothing), and serves with it; `miles-lite engine` refuses an open routable address."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from engine_auth import Endpoint, call, keyed_engine, statuses  # noqa: E402
from engine_contract import GREEDY, PROMPT, save_tiny_qwen2  # noqa: E402

from miles_lite.config.schema import RolloutConfig  # noqa: E402
from miles_lite.net.api_key import authorization, new_key  # noqa: E402
from miles_lite.rollout.engine import EngineError  # noqa: E402
from miles_lite.rollout.http_client import HttpEngine  # noqa: E402

# With the key: what the reference engine answers each deliberately valid or malformed request.
SERVED = {"POST /update_weights_from_tensor": 400, "POST /init_weights_update_group": 400,
          "POST /update_weights_from_distributed": 400, "POST /destroy_weights_update_group": 400}


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory):
    model = save_tiny_qwen2(str(tmp_path_factory.mktemp("model")), seed=0)
    rollout = RolloutConfig(backend="reference", engines=1, startup_timeout_s=300, request_timeout_s=120,
                            reference_args={"threads": 1})
    with keyed_engine(rollout, model, tmp_path_factory.mktemp("engine")) as (launched, key):
        yield launched, key, model


def test_every_endpoint_asks_for_the_key(keyed) -> None:
    launched, key, model = keyed
    url = launched.process.url
    before = asyncio.run(launched.client.weight_version())
    seen = statuses(url, key.value, model)
    assert len(seen) == 18
    for route, (none, bad, good) in seen.items():
        assert (none, bad) == (401, 401), f"{route}: without a key {none}, with a wrong key {bad}"
        assert good == SERVED.get(route, 200), f"{route} with the key answered {good}"
    # Only the keyed calls did anything: the version is the one the keyed /update_weight_version set.
    assert before == "default"
    assert asyncio.run(launched.client.weight_version()) == "auth-check"


def test_unauthenticated_calls_do_no_work(keyed) -> None:
    launched, key, model = keyed
    url = launched.process.url
    for headers in ({}, authorization(new_key()), {"Authorization": key.value}, {"Authorization": "Basic x"}):
        assert call(url, Endpoint("POST", "/pause_generation", {"mode": "abort"}), headers)[0] == 401
        assert call(url, Endpoint("POST", "/update_weight_version", {"new_version": "intruder"}), headers)[0] == 401
    client = launched.client
    assert asyncio.run(client.weight_version()) != "intruder"
    # Not paused: a keyed generation completes at once.
    gen = asyncio.run(client.generate(PROMPT, GREEDY))
    assert len(gen.output_ids) == GREEDY.max_new_tokens


def test_health_is_open_and_says_nothing_more(keyed) -> None:
    launched, _, _ = keyed
    status, body = call(launched.process.url, Endpoint("GET", "/health"), {})
    assert status == 200 and body == ""


def test_client_without_the_key_gets_401(keyed) -> None:
    launched, _, _ = keyed
    stranger = HttpEngine("stranger", launched.process.url, api_key=new_key())

    async def ask() -> None:
        try:
            assert not await stranger.health(10.0)
            with pytest.raises(EngineError, match="HTTP 401"):
                await stranger.generate(PROMPT, GREEDY)
        finally:
            await stranger.close()

    asyncio.run(ask())


def test_engine_refuses_a_routable_address_without_a_key(tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("MILES_API_KEY", "MILES_API_KEY_FILE")}
    cmd = [sys.executable, "-m", "miles_lite.cli", "engine", "--model-path", str(tmp_path), "--host", "0.0.0.0"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2
    assert "--api-key-file" in proc.stderr and "--insecure" in proc.stderr
