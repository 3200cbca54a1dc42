"""Stock SGLang behind the run's API key (`engines.sglang.launch`): every endpoint answers 401 without the key
and with a wrong one, including those SGLang's own `--api-key` leaves open (`/health_generate`, `/metrics`,
`/ready`), and is served with it; `/health` stays open; the key is on no command line of the server's processes.

Skipped unless sglang is importable and a CUDA device is present.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "integration"))

from engine_auth import Endpoint, call, keyed_engine, statuses  # noqa: E402
from engine_contract import SGLANG_TEST_ARGS, save_tiny_qwen2  # noqa: E402

from miles_lite.config.schema import RolloutConfig  # noqa: E402
from miles_lite.engines.launcher import LaunchedEngine  # noqa: E402
from miles_lite.engines.sglang.command import sglang_available  # noqa: E402
from miles_lite.net.api_key import ApiKey, authorization, new_key  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not sglang_available(), reason="needs sglang and a CUDA GPU")]

# Paths SGLang's own --api-key leaves open (they start with /health, /ready or /metrics); the launcher closes them.
SGLANG_OPEN = [Endpoint("GET", "/metrics"), Endpoint("GET", "/ready"), Endpoint("GET", "/v1/models")]


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LaunchedEngine, ApiKey, str]]:
    model = save_tiny_qwen2(str(tmp_path_factory.mktemp("model")), seed=0)
    rollout = RolloutConfig(backend="sglang", engines=1, engine_tp=1, startup_timeout_s=600, request_timeout_s=120,
                            sglang_args={**SGLANG_TEST_ARGS, "enable_metrics": True})
    with keyed_engine(rollout, model, tmp_path_factory.mktemp("engine")) as (launched, key):
        yield launched, key, model


def test_every_sglang_endpoint_asks_for_the_key(keyed) -> None:
    launched, key, model = keyed
    url = launched.process.url
    seen = statuses(url, key.value, model)
    for route, (none, bad, good) in seen.items():
        assert (none, bad) == (401, 401), f"{route}: without a key {none}, with a wrong key {bad}"
        # Served: SGLang's own answer (200, or its 4xx for the deliberately malformed bodies; 404 for an alias
        # this version lacks), never the key check's.
        assert good not in (401, 403), f"{route} with the key answered {good}"
    for route in ("POST /generate", "GET /health_generate", "GET /model_info", "GET /get_server_info",
                  "GET /get_load", "POST /pause_generation", "POST /continue_generation",
                  "POST /update_weight_version", "POST /update_weights_from_disk"):
        assert seen[route][2] == 200, f"{route} with the key answered {seen[route][2]}"
    for endpoint in SGLANG_OPEN:
        assert call(url, endpoint, {})[0] == 401, endpoint.path
        assert call(url, endpoint, authorization(new_key()))[0] == 401, endpoint.path
        # /ready is newer than some pinned versions (0.5.17 has none: 404 with the key, still 401 without).
        served = (200, 404) if endpoint.path == "/ready" else (200,)
        assert call(url, endpoint, authorization(key.value))[0] in served, endpoint.path
    assert call(url, Endpoint("GET", "/health"), {})[0] == 200
    assert asyncio.run(launched.client.weight_version()) == "auth-check"


def _descendants(root: int) -> list[int]:
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        try:
            parents[int(entry)] = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (ValueError, OSError):
            continue
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += [child for child, parent in parents.items() if parent == pid]
    return out


def test_the_key_is_on_no_command_line_of_the_server(keyed) -> None:
    launched, key, _ = keyed
    assert launched.process.pid is not None
    pids = _descendants(launched.process.pid)
    assert len(pids) >= 3  # the supervisor, SGLang's server and its scheduler
    for pid in pids:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        assert key.value.encode() not in cmdline, cmdline[:200]
    log = Path(launched.process.log_path).read_text(errors="replace")
    assert key.value not in log and "--api-key-file" in log
