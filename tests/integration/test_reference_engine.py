"""The reference engine: the RolloutEngine contract, plus batching, weight transports and fault injection.

Every server here is a real `python -m miles_lite.engines.reference.engine` process on a tiny random Qwen2.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, os.path.dirname(__file__))

from engine_contract import (  # noqa: E402
    GREEDY,
    PROMPT,
    EngineContract,
    EnginePool,
    engine,  # noqa: F401  (fixture)
    engine_pool,  # noqa: F401  (fixture)
    hf_logprobs,
    model_dirs,  # noqa: F401  (fixture)
    run,
    running_engine,
)

from miles_lite.engines.launcher import LaunchedEngine  # noqa: E402
from miles_lite.engines.reference.model import serialize_named_tensors  # noqa: E402
from miles_lite.net.ports import LOCAL_HOST, free_port  # noqa: E402
from miles_lite.rollout.engine import EngineError  # noqa: E402
from miles_lite.types import SamplingParams  # noqa: E402
from miles_lite.weight_sync.weight_group import init_custom_process_group  # noqa: E402


class TestEngineContract(EngineContract):
    """The shared contract, on every engine kind available here."""


@pytest.fixture(scope="module")
def reference(engine_pool: EnginePool) -> LaunchedEngine:  # noqa: F811
    """The contract's reference engine (one server process for the whole module)."""
    return engine_pool.get("reference")


def _named_tensors(model_dir: str) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(model_dir, "model.safetensors"))


def test_concurrent_requests_are_batched(reference: LaunchedEngine) -> None:
    params = SamplingParams(max_new_tokens=32, temperature=1.0, ignore_eos=True)
    prompts = [[(7 * i + j) % 500 + 1 for j in range(4 + i % 5)] for i in range(16)]

    async def sequential() -> float:
        start = time.perf_counter()
        for p in prompts:
            await reference.client.generate(p, params)
        return time.perf_counter() - start

    async def concurrent() -> tuple[float, list[Any]]:
        start = time.perf_counter()
        gens = await asyncio.gather(*(reference.client.generate(p, params) for p in prompts))
        return time.perf_counter() - start, gens

    run(reference.client.generate(PROMPT, GREEDY))  # warm-up
    t_seq = run(sequential())
    t_con, gens = run(concurrent())
    print(f"\n16 requests x 32 tokens: sequential {t_seq:.2f}s, concurrent {t_con:.2f}s ({t_seq / t_con:.1f}x)")
    assert all(len(g.output_ids) == 32 for g in gens)
    assert t_con < t_seq / 2


def test_batched_greedy_matches_single_requests(reference: LaunchedEngine, model_dirs: tuple[str, str]) -> None:  # noqa: F811
    prompts = [PROMPT, [1, 2], list(range(10, 30)), [400]]

    async def scenario() -> tuple[list[Any], list[Any]]:
        together = await asyncio.gather(*(reference.client.generate(p, GREEDY) for p in prompts))
        alone = [await reference.client.generate(p, GREEDY) for p in prompts]
        return together, alone

    together, alone = run(scenario())
    for p, t, a in zip(prompts, together, alone, strict=True):
        assert t.output_ids == a.output_ids
        expected = hf_logprobs(model_dirs[0], p + list(t.output_ids), len(p))
        assert max(abs(x - y) for x, y in zip(t.output_logprobs, expected, strict=True)) < 1e-4


def test_retract_pause_recomputes_and_finishes(reference: LaunchedEngine) -> None:
    async def scenario() -> tuple[Any, Any]:
        baseline = await reference.client.generate(PROMPT, GREEDY)
        task = asyncio.create_task(reference.client.generate(PROMPT, SamplingParams(
            max_new_tokens=12, temperature=0.0, ignore_eos=True)))
        while (await reference.client.load())[0]["num_reqs"] < 1:
            await asyncio.sleep(0.01)
        await reference.client.pause(mode="retract")
        load = (await reference.client.load())[0]
        assert load["num_reqs"] == 0
        await reference.client.resume()
        return baseline, await task

    baseline, gen = run(scenario())
    assert gen.output_ids == baseline.output_ids


def test_update_from_tensor_changes_and_restores(reference: LaunchedEngine, model_dirs: tuple[str, str]) -> None:  # noqa: F811
    a_dir, b_dir = model_dirs

    async def scenario() -> tuple[Any, Any, Any, list[Any]]:
        before = await reference.client.generate(PROMPT, GREEDY)
        payload = serialize_named_tensors(_named_tensors(b_dir).items())
        await reference.client.update_weights_from_tensor([payload], None, "tensor-b")
        during = await reference.client.generate(PROMPT, GREEDY)
        norm = await reference.client.get_weights_by_name("model.norm.weight", 8)
        await reference.client.update_weights_from_disk(a_dir, "default")
        after = await reference.client.generate(PROMPT, GREEDY)
        return before, during, after, norm

    before, during, after, norm = run(scenario())
    assert during.weight_version == "tensor-b" and during.output_logprobs != before.output_logprobs
    assert norm == pytest.approx(_named_tensors(b_dir)["model.norm.weight"][:8].tolist())
    assert after.output_ids == before.output_ids


def test_bad_tensor_update_is_an_error_and_changes_nothing(reference: LaunchedEngine) -> None:
    payload = serialize_named_tensors([("model.norm.weight", torch.zeros(3))])
    with pytest.raises(EngineError, match="shape mismatch"):
        run(reference.client.update_weights_from_tensor([payload], None, "bad"))
    unknown = serialize_named_tensors([("model.not_a_weight", torch.zeros(3))])
    with pytest.raises(EngineError, match="unknown parameter"):
        run(reference.client.update_weights_from_tensor([unknown], None, "bad"))
    assert run(reference.client.weight_version()) != "bad"


def test_update_over_gloo_group_from_trainer_rank0(reference: LaunchedEngine, model_dirs: tuple[str, str]) -> None:  # noqa: F811
    a_dir, b_dir = model_dirs
    new = _named_tensors(b_dir)
    names = sorted(new)
    port = free_port(LOCAL_HOST)
    groups: dict[str, Any] = {}

    def trainer_join() -> None:
        groups["pg"] = init_custom_process_group("gloo", "127.0.0.1", port, 0, 2, "wsync", timeout_s=120)

    def trainer_send() -> None:
        for name in names:
            torch.distributed.broadcast(new[name].contiguous(), src=0, group=groups["pg"])

    async def scenario() -> tuple[Any, Any, list[Any]]:
        before = await reference.client.generate(PROMPT, GREEDY)
        joiner = threading.Thread(target=trainer_join)
        joiner.start()
        await reference.client.init_weights_update_group("127.0.0.1", port, 1, 2, "wsync", "gloo")
        await asyncio.to_thread(joiner.join)
        sender = threading.Thread(target=trainer_send)
        sender.start()
        await reference.client.update_weights_from_distributed(
            names, [str(new[n].dtype).removeprefix("torch.") for n in names], [list(new[n].shape) for n in names],
            "wsync", "dist-b")
        await asyncio.to_thread(sender.join)
        during = await reference.client.generate(PROMPT, GREEDY)
        emb = await reference.client.get_weights_by_name("model.embed_tokens.weight", 2)
        await reference.client.destroy_weights_update_group("wsync")
        torch.distributed.destroy_process_group(groups["pg"])
        await reference.client.update_weights_from_disk(a_dir, "default")
        return before, during, emb

    before, during, emb = run(scenario())
    assert during.weight_version == "dist-b" and during.output_logprobs != before.output_logprobs
    assert torch.allclose(torch.tensor(emb), new["model.embed_tokens.weight"][:2])
    expected = hf_logprobs(b_dir, PROMPT + list(during.output_ids), len(PROMPT))
    assert max(abs(x - y) for x, y in zip(during.output_logprobs, expected, strict=True)) < 1e-4


def test_bad_generate_requests_answer_400(reference: LaunchedEngine) -> None:
    with pytest.raises(EngineError, match="HTTP 400.*vocabulary"):
        run(reference.client.generate([100000], GREEDY))
    with pytest.raises(EngineError, match="HTTP 400.*top_p"):
        run(reference.client.generate(PROMPT, SamplingParams(top_p=0.0)))
    with pytest.raises(EngineError, match="HTTP 400.*stop needs a tokenizer"):
        run(reference.client.generate(PROMPT, SamplingParams(stop=("x",))))


def test_malformed_bodies_and_nonfinite_temperature_answer_400(reference: LaunchedEngine) -> None:
    import json
    import urllib.error
    import urllib.request

    def post(path: str, body: bytes) -> tuple[int, str]:
        req = urllib.request.Request(f"{reference.process.url}{path}", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                return resp.status, resp.read().decode()
        except urllib.error.HTTPError as err:
            return err.code, err.read().decode()

    for path in ("/abort_request", "/pause_generation", "/generate"):
        status, text = post(path, b"{not json")
        assert status == 400 and "not valid JSON" in json.loads(text)["error"]["message"], (path, status, text)
        status, text = post(path, b"[1, 2]")
        assert status == 400 and "JSON object" in text, (path, status, text)
    for value in ("NaN", "Infinity"):  # what Python's json writes for float("nan") / float("inf")
        body = f'{{"input_ids": {list(PROMPT)}, "sampling_params": {{"temperature": {value}}}}}'.encode()
        status, text = post("/generate", body)
        assert status == 400 and "temperature must be a finite number" in text, (value, status, text)
    assert post("/continue_generation", b"")[0] == 200  # the engine serves on


def test_drop_weight_updates_acknowledges_but_keeps_weights(model_dirs: tuple[str, str], tmp_path: Any) -> None:  # noqa: F811
    a_dir, b_dir = model_dirs
    with running_engine("reference", a_dir, str(tmp_path), reference_args={"drop_weight_updates": True}) as eng:
        async def scenario() -> tuple[Any, Any, str, list[Any]]:
            before = await eng.client.generate(PROMPT, GREEDY)
            await eng.client.update_weights_from_disk(b_dir, "silently-dropped")  # no error: that is the point
            after = await eng.client.generate(PROMPT, GREEDY)
            norm = await eng.client.get_weights_by_name("model.norm.weight", 4)
            return before, after, await eng.client.weight_version(), norm

        before, after, version, norm = run(scenario())
    assert version == "silently-dropped" and after.weight_version == "silently-dropped"
    assert after.output_logprobs == before.output_logprobs
    assert norm == pytest.approx(_named_tensors(a_dir)["model.norm.weight"][:4].tolist())


@pytest.mark.parametrize("mode", ["hang", "error"])
def test_fail_modes(mode: str, model_dirs: tuple[str, str], tmp_path: Any) -> None:  # noqa: F811
    args = {"fail_mode": mode, "fail_after": 1}
    with running_engine("reference", model_dirs[0], str(tmp_path), reference_args=args, request_timeout_s=3.0) as eng:
        first = run(eng.client.generate(PROMPT, GREEDY))
        assert first.finish_reason == "length"
        start = time.monotonic()
        with pytest.raises(EngineError, match="TimeoutError" if mode == "hang" else "HTTP 500"):
            run(eng.client.generate(PROMPT, GREEDY))
        if mode == "hang":
            assert time.monotonic() - start >= 2.5
        assert not run(eng.client.health(timeout_s=2.0))
        assert eng.process.alive()  # the process lives on: only its answers are broken
