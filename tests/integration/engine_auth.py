"""Every endpoint of an engine server, asked without the run's API key, with a wrong one and with it.

Shared by the reference engine's test (CI) and SGLang's (GPU machine). `ENDPOINTS` lists each route the
engines serve with a request that is valid or harmless with the key: the point is who gets an answer.
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles_lite.config.schema import RolloutConfig
from miles_lite.engines.launcher import EngineLauncher, LaunchedEngine
from miles_lite.net.api_key import ApiKey, authorization, new_key


@dataclass(frozen=True)
class Endpoint:
    method: str
    path: str
    body: dict[str, Any] | None = None


def endpoints(model_path: str) -> list[Endpoint]:
    """Every route of SGLang's native API the engines serve (the reference engine serves exactly these)."""
    prompt = {"input_ids": [5, 17, 42], "sampling_params": {"max_new_tokens": 2, "temperature": 0.0},
              "return_logprob": True}
    return [
        Endpoint("POST", "/generate", prompt),
        Endpoint("GET", "/health_generate"),
        Endpoint("GET", "/model_info"), Endpoint("GET", "/get_model_info"),
        Endpoint("GET", "/server_info"), Endpoint("GET", "/get_server_info"),
        Endpoint("GET", "/get_load"),
        Endpoint("POST", "/flush_cache"),
        Endpoint("POST", "/pause_generation", {"mode": "abort"}),
        Endpoint("POST", "/continue_generation", {}),
        Endpoint("POST", "/abort_request", {"abort_all": True}),
        Endpoint("POST", "/update_weight_version", {"new_version": "auth-check", "abort_all_requests": False}),
        Endpoint("POST", "/update_weights_from_disk", {"model_path": model_path}),
        # Malformed on purpose: with the key the handler answers it (400), without it nothing is decoded.
        Endpoint("POST", "/update_weights_from_tensor", {"serialized_named_tensors": ["not a payload"]}),
        Endpoint("POST", "/init_weights_update_group", {"group_name": "auth-check"}),
        # Malformed too (no `names`): a well-formed update for a group that does not exist kills SGLang
        # 0.5.17's scheduler (an assertion), so only the handler's own validation may answer it.
        Endpoint("POST", "/update_weights_from_distributed", {"group_name": "auth-check"}),
        Endpoint("POST", "/destroy_weights_update_group", {"group_name": "auth-check"}),
        Endpoint("POST", "/get_weights_by_name", {"name": "lm_head.weight", "truncate_size": 2}),
    ]


def call(url: str, endpoint: Endpoint, headers: dict[str, str], timeout_s: float = 120.0) -> tuple[int, str]:
    """(HTTP status, body) of one request."""
    data = None if endpoint.body is None else json.dumps(endpoint.body).encode()
    request = urllib.request.Request(url + endpoint.path, data=data, method=endpoint.method,
                                     headers={**headers, **({"Content-Type": "application/json"} if data else {})})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            return resp.status, resp.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


def statuses(url: str, key: str, model_path: str) -> dict[str, tuple[int, int, int]]:
    """path -> (status without a key, with a wrong key, with the key)."""
    wrong = authorization(new_key())
    out: dict[str, tuple[int, int, int]] = {}
    for endpoint in endpoints(model_path):
        none = call(url, endpoint, {})[0]
        bad = call(url, endpoint, wrong)[0]
        good = call(url, endpoint, authorization(key))[0]
        out[f"{endpoint.method} {endpoint.path}"] = (none, bad, good)
    return out


@contextmanager
def keyed_engine(rollout: RolloutConfig, model: str, root: Path) -> Iterator[tuple[LaunchedEngine, ApiKey]]:
    """Engine 0 of `rollout` serving `model` behind a fresh private key (files under `root`); stopped after."""
    for sub in ("keys", "logs"):
        (root / sub).mkdir(exist_ok=True)
    key = ApiKey.private(new_key(), parent=str(root / "keys"))
    launcher = EngineLauncher(rollout, model, str(root / "logs"), api_key=key)
    launched = asyncio.run(launcher.start(0))
    try:
        yield launched, key
    finally:
        asyncio.run(launcher.stop(launched))
        key.close()
