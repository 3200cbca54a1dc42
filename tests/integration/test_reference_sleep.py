"""The reference engine's sleep/wake on the server side: what it frees, what it refuses and answers, and why.

The client (`HttpEngine`) refuses generation itself once it released memory; these tests speak HTTP
directly, as another client (or a client of a restarted driver) would, so the server's own refusals show.
"""

from __future__ import annotations

import json
import math
import os
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from engine_contract import PROMPT, model_dirs, run, running_engine  # noqa: E402, F401  (fixture)

from miles_lite.engines.reference.model import ReferenceModel  # noqa: E402
from miles_lite.engines.reference.shards import ShardedWeights  # noqa: E402
from miles_lite.types import SamplingParams  # noqa: E402


def _post(url: str, path: str, body: dict[str, Any]) -> tuple[int, str]:
    req = urllib.request.Request(f"{url}{path}", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def test_release_frees_the_model_and_resume_restores_it_only_from_a_host_copy(
        model_dirs: tuple[str, str]) -> None:  # noqa: F811
    model = ReferenceModel(model_dirs[0])
    weights = ShardedWeights(model, tp=2)
    before = {n: p.detach().clone() for n, p in model.model.named_parameters()}
    weights.release(keep_host_copy=True)
    assert all(p.numel() == 0 and p.untyped_storage().nbytes() == 0 for p in model.model.parameters())
    assert weights.resume() == len(before)
    after = dict(model.model.named_parameters())
    assert all(torch.equal(before[n], after[n]) for n in before)

    # Without the host copy (SGLang's default) the released bytes are gone: zeros until a weight update.
    weights.release(keep_host_copy=False)
    assert weights.resume() == len(before)
    assert all(not p.any() for p in model.model.parameters())
    assert weights.load_full(list(before.items())) == len(before)
    assert all(torch.equal(before[n], p) for n, p in model.model.named_parameters())


def test_a_wake_without_a_host_copy_serves_only_after_a_full_push(model_dirs: tuple[str, str],  # noqa: F811
                                                                  tmp_path: Any) -> None:
    # What a colocated hand-off relies on: the push after the wake must carry every weight (an adapter-only
    # push must not release the base at all), and a wake without one serves garbage, not the old model.
    tokens = PROMPT + [7, 8, 9, 10, 300]
    with running_engine("reference", model_dirs[0], str(tmp_path)) as eng:
        before = run(eng.client.score(tokens, len(PROMPT)))
        run(eng.client.release_memory(["weights", "kv_cache"]))
        run(eng.client.resume_memory(["weights", "kv_cache"]))
        lost = run(eng.client.score(tokens, len(PROMPT)))
        # All-zero weights: zero logits, every token at log(1/vocab) (the random model is only near that).
        vocab = json.loads((Path(model_dirs[0]) / "config.json").read_text())["vocab_size"]
        assert lost == pytest.approx([-math.log(vocab)] * len(lost), abs=1e-5) and lost != before
        run(eng.client.release_memory(["weights", "kv_cache"]))
        run(eng.client.resume_memory(["weights"]))
        assert _post(eng.process.url, "/update_weights_from_disk", {"model_path": model_dirs[0]})[0] == 200
        run(eng.client.resume_memory(["kv_cache"]))
        assert run(eng.client.score(tokens, len(PROMPT))) == before


def test_the_server_refuses_generation_and_weight_loads_while_asleep(model_dirs: tuple[str, str],  # noqa: F811
                                                                     tmp_path: Any) -> None:
    with running_engine("reference", model_dirs[0], str(tmp_path)) as eng:
        url = eng.process.url
        generate = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4, "temperature": 0.0}}
        assert _post(url, "/resume_memory_occupation", {"tags": ["weights"]})[0] == 400
        status, text = _post(url, "/release_memory_occupation", {"tags": ["weights", "bogus"]})
        assert status == 400 and "unknown memory tags ['bogus']" in text
        assert _post(url, "/release_memory_occupation", {"tags": ["weights"]})[0] == 200
        status, text = _post(url, "/release_memory_occupation", {"tags": ["weights"]})
        assert status == 400 and "released already" in text

        status, text = _post(url, "/generate", generate)
        assert status == 503
        assert json.loads(text)["error"]["message"] == ("the engine's memory is released (weights): resume it with "
                                                        "/resume_memory_occupation before generating")
        with urllib.request.urlopen(f"{url}/get_server_info", timeout=30) as resp:
            assert json.loads(resp.read())["internal_states"][0]["memory_released"] == ["weights"]
        try:
            urllib.request.urlopen(f"{url}/health_generate", timeout=30)
            raise AssertionError("health_generate answered 200 while asleep")
        except urllib.error.HTTPError as err:
            assert err.code == 503
        status, text = _post(url, "/update_weights_from_disk", {"model_path": model_dirs[1], "weight_version": "b"})
        assert status == 400 and "weights are released" in text
        assert run(eng.client.weight_version()) == "default"  # nothing was loaded

        # Weights back, KV cache released: a weight load is allowed (the push of a waking engine), generation not.
        assert _post(url, "/release_memory_occupation", {"tags": ["kv_cache"]})[0] == 200
        assert _post(url, "/resume_memory_occupation", {"tags": ["weights"]})[0] == 200
        status, _ = _post(url, "/update_weights_from_disk", {"model_path": model_dirs[1], "weight_version": "b"})
        assert status == 200
        status, text = _post(url, "/generate", generate)
        assert status == 503 and "(kv_cache)" in text
        assert _post(url, "/resume_memory_occupation", {})[0] == 400  # weights and cuda_graph are not released
        assert _post(url, "/resume_memory_occupation", {"tags": ["kv_cache"]})[0] == 200
        status, text = _post(url, "/generate", generate)
        assert status == 200 and json.loads(text)["meta_info"]["weight_version"] == "b"


def test_release_is_refused_while_a_request_runs(model_dirs: tuple[str, str], tmp_path: Any) -> None:  # noqa: F811
    import asyncio

    with running_engine("reference", model_dirs[0], str(tmp_path)) as eng:
        async def scenario() -> tuple[int, str, str]:
            task = asyncio.create_task(eng.client.generate(PROMPT, SamplingParams(max_new_tokens=2000,
                                                                                  temperature=1.0, ignore_eos=True)))
            while (await eng.client.load())[0]["num_reqs"] < 1:
                await asyncio.sleep(0.02)  # poll until the request runs
            status, text = await asyncio.to_thread(_post, eng.process.url, "/release_memory_occupation", {})
            await eng.client.abort()
            return status, text, (await task).finish_reason

        status, text, reason = run(scenario())
    assert status == 400 and "requests are in flight" in text and reason == "abort"
