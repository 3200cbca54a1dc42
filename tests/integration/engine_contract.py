"""The RolloutEngine contract, run against real engine servers of every kind.

`ENGINE_KINDS` parameterises the module-scoped `engine` fixture: `reference` (the CPU engine, runs in CI) and
`sglang` (a stock `sglang.launch_server`, only where sglang is importable and a GPU is present). A test module
takes the suite with

    from engine_contract import EngineContract, engine, engine_pool, model_dirs  # noqa: F401  (fixtures)
    class TestEngineContract(EngineContract): ...

and every kind's server then serves all of the class's tests (one start per kind and module).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from miles_lite.config.schema import RolloutConfig
from miles_lite.engines.launcher import EngineLauncher, LaunchedEngine
from miles_lite.engines.sglang.command import sglang_available
from miles_lite.rollout.engine import RolloutEngine
from miles_lite.types import SamplingParams

ENGINE_KINDS = [
    pytest.param("reference", id="reference"),
    pytest.param("sglang", id="sglang", marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(not sglang_available(), reason="needs sglang importable and a CUDA GPU"),
    ]),
]

REPO = Path(__file__).resolve().parents[2]


def shipped_sglang_args() -> dict[str, Any]:
    """`conf/rollout/sglang.yaml`'s sglang_args: what a user's run starts SGLang with."""
    return dict(yaml.safe_load((REPO / "conf" / "rollout" / "sglang.yaml").read_text())["sglang_args"])


# SGLang flags for a token-in/token-out server on one GPU (no tokenizer in the tiny model directory), over the
# shipped defaults. float32, so log-probs compare with an HF float32 forward: SGLang 0.5.17's CUDA RMSNorm kernel
# has no float32 path (Qwen3-MoE and LoRA engines died at start-up), its batch-invariant mode (deterministic
# inference, which seeded sampling needs anyway) normalises in Triton or PyTorch, which do.
SGLANG_TEST_ARGS: dict[str, Any] = {**shipped_sglang_args(), "skip_tokenizer_init": True, "mem_fraction_static": 0.3,
                                    "attention_backend": "triton", "sampling_backend": "pytorch",
                                    "disable_cuda_graph": True, "dtype": "float32",
                                    "enable_deterministic_inference": True}
# The contract's engine also sleeps and wakes: the memory saver (what /release_memory_occupation needs; the
# launcher also drops expandable_segments from its environment), with a host copy of the weights so sleep/wake
# keeps them without a push in between. Only engines that sleep start with it, so a memory-saver failure shows
# in the sleep tests alone.
SGLANG_SLEEP_ARGS: dict[str, Any] = {**SGLANG_TEST_ARGS, "enable_memory_saver": True,
                                     "enable_weights_cpu_backup": True}
REFERENCE_SLEEP_ARGS: dict[str, Any] = {"enable_weights_cpu_backup": True}
# Largest |engine logprob - HF float32 logprob| accepted, per kind. SGLang's GPU kernels round otherwise: up to
# 2.4e-3 seen on 0.5.17 in float32; two tokens' log-probs at one position differ by tenths, so a wrong token fails.
LOGPROB_TOL = {"reference": 1e-4, "sglang": 5e-3}


def tolerance(engine: LaunchedEngine) -> float:
    """The logprob tolerance of `engine`'s kind."""
    return LOGPROB_TOL[engine.client.engine_id.rsplit("-", 1)[0]]


def run(coro: Any) -> Any:
    """Run a coroutine to completion on a fresh event loop (the tests are synchronous)."""
    return asyncio.run(coro)


def save_tiny_qwen2(path: str, seed: int) -> str:
    """A random tiny Qwen2 (vocab 512, 2 layers, tied embeddings) saved as safetensors; returns `path`."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=512, tie_word_embeddings=True,
                         max_position_embeddings=1024)
    Qwen2ForCausalLM(config).save_pretrained(path, safe_serialization=True)
    return path


def hf_logprobs(model_path: str, tokens: list[int], prompt_len: int, temperature: float = 1.0) -> list[float]:
    """log_softmax(logits / temperature) of tokens[prompt_len:] under a plain HF forward pass (reference)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens])).logits[0].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return [float(logp[i - 1, tokens[i]]) for i in range(prompt_len, len(tokens))]


@contextlib.contextmanager
def running_engine(kind: str, model_path: str, log_dir: str, reference_args: dict[str, Any] | None = None,
                   request_timeout_s: float = 120.0,
                   sglang_args: dict[str, Any] | None = None) -> Iterator[LaunchedEngine]:
    """Start one engine server of `kind` and stop it (its whole process group) afterwards; `reference_args` /
    `sglang_args` add to (and override) the test flags of that kind."""
    rollout = RolloutConfig(backend=kind, engines=1, engine_tp=1, startup_timeout_s=600.0,
                            request_timeout_s=request_timeout_s,
                            reference_args={"max_batch_size": 32, "threads": 1, **(reference_args or {})},
                            sglang_args={**SGLANG_TEST_ARGS, **(sglang_args or {})})
    launcher = EngineLauncher(rollout, model_path, log_dir)
    launched = run(launcher.start(0))
    try:
        yield launched
    finally:
        run(launcher.stop(launched))


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """Two tiny models with different random weights (A is what engines start with)."""
    root = tmp_path_factory.mktemp("models")
    return save_tiny_qwen2(str(root / "a"), seed=0), save_tiny_qwen2(str(root / "b"), seed=1)


class EnginePool:
    """Engines started on first use, one per kind, all stopped at `close()`."""

    def __init__(self, model_path: str, log_root: pytest.TempPathFactory) -> None:
        self._model_path = model_path
        self._log_root = log_root
        self._stack = contextlib.ExitStack()
        self._engines: dict[str, LaunchedEngine] = {}

    def get(self, kind: str) -> LaunchedEngine:
        if kind not in self._engines:
            log_dir = str(self._log_root.mktemp(f"logs-{kind}"))
            self._engines[kind] = self._stack.enter_context(
                running_engine(kind, self._model_path, log_dir, sglang_args=SGLANG_SLEEP_ARGS,
                               reference_args=REFERENCE_SLEEP_ARGS))
        return self._engines[kind]

    def close(self) -> None:
        self._stack.close()


@pytest.fixture(scope="module")
def engine_pool(model_dirs: tuple[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[EnginePool]:
    """The module's shared engines (model A), so the contract and kind-specific tests share one start."""
    pool = EnginePool(model_dirs[0], tmp_path_factory)
    try:
        yield pool
    finally:
        pool.close()


@pytest.fixture(scope="module", params=ENGINE_KINDS)
def engine(request: pytest.FixtureRequest, engine_pool: EnginePool) -> LaunchedEngine:
    """One running engine of each kind, shared by the module's tests."""
    return engine_pool.get(request.param)


GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
PROMPT = [5, 17, 42, 99, 3, 250]


async def _wait_for(engine: Any, predicate: Any, timeout_s: float = 30.0) -> dict[str, Any]:
    """Poll `/get_load` until `predicate(load)` holds; returns that load entry."""
    deadline = time.monotonic() + timeout_s
    while True:
        load = (await engine.load())[0]
        if predicate(load):
            return load
        if time.monotonic() > deadline:
            raise AssertionError(f"engine load never satisfied the condition; last {load}")
        await asyncio.sleep(0.05)


class EngineContract:
    """What every RolloutEngine must do; `engine` and `model_dirs` are fixtures of the using module."""

    def test_is_rollout_engine(self, engine: LaunchedEngine) -> None:
        assert isinstance(engine.client, RolloutEngine)
        assert engine.process.alive()

    def test_health(self, engine: LaunchedEngine) -> None:
        assert run(engine.client.health(timeout_s=30.0))

    def test_generate_shapes_and_length_finish(self, engine: LaunchedEngine) -> None:
        gen = run(engine.client.generate(PROMPT, GREEDY))
        assert len(gen.output_ids) == len(gen.output_logprobs) == GREEDY.max_new_tokens
        assert gen.finish_reason == "length"
        assert all(lp <= 0.0 for lp in gen.output_logprobs)
        assert gen.engine_id == engine.client.engine_id and gen.weight_version

    def test_greedy_is_deterministic_and_seeded_sampling_repeats(self, engine: LaunchedEngine) -> None:
        async def twice(params: SamplingParams) -> tuple[Any, Any]:
            return await engine.client.generate(PROMPT, params), await engine.client.generate(PROMPT, params)

        a, b = run(twice(GREEDY))
        assert a.output_ids == b.output_ids
        seeded = SamplingParams(max_new_tokens=12, temperature=1.0, ignore_eos=True, seed=1234)
        c, d = run(twice(seeded))
        assert c.output_ids == d.output_ids

    def test_logprobs_match_hf_forward(self, engine: LaunchedEngine, model_dirs: tuple[str, str]) -> None:
        gen = run(engine.client.generate(PROMPT, GREEDY))
        expected = hf_logprobs(model_dirs[0], PROMPT + list(gen.output_ids), len(PROMPT))
        assert max(abs(a - b) for a, b in zip(gen.output_logprobs, expected, strict=True)) < tolerance(engine)
        # Sampled tokens are reported under the temperature-scaled distribution, as SGLang does by default.
        hot = run(engine.client.generate(PROMPT, SamplingParams(max_new_tokens=8, temperature=0.7, seed=7,
                                                                ignore_eos=True)))
        expected = hf_logprobs(model_dirs[0], PROMPT + list(hot.output_ids), len(PROMPT), temperature=0.7)
        assert max(abs(a - b) for a, b in zip(hot.output_logprobs, expected, strict=True)) < tolerance(engine)

    def test_score_matches_hf_forward(self, engine: LaunchedEngine, model_dirs: tuple[str, str]) -> None:
        tokens = PROMPT + [7, 8, 9, 10, 300]
        scores = run(engine.client.score(tokens, len(PROMPT)))
        expected = hf_logprobs(model_dirs[0], tokens, len(PROMPT))
        assert len(scores) == 5
        assert max(abs(a - b) for a, b in zip(scores, expected, strict=True)) < tolerance(engine)

    def test_score_of_the_first_and_last_vocabulary_ids(self, engine: LaunchedEngine,
                                                        model_dirs: tuple[str, str]) -> None:
        # SGLang reports the last id (511) as 0 in input log-probs; the client accepts exactly that, and the
        # values must still be those of ids 511 and 0 at their positions.
        tokens = PROMPT + [511, 0, 511, 511, 5, 0]
        scores = run(engine.client.score(tokens, len(PROMPT)))
        expected = hf_logprobs(model_dirs[0], tokens, len(PROMPT))
        assert len(scores) == 6
        assert max(abs(a - b) for a, b in zip(scores, expected, strict=True)) < tolerance(engine), (scores, expected)

    def test_stop_token_ids(self, engine: LaunchedEngine) -> None:
        base = run(engine.client.generate(PROMPT, GREEDY))
        stop_at = base.output_ids.index(base.output_ids[3])  # first occurrence of the 4th token
        params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True,
                                stop_token_ids=(base.output_ids[3],))
        gen = run(engine.client.generate(PROMPT, params))
        assert gen.finish_reason == "stop"
        assert gen.output_ids == base.output_ids[: stop_at + 1]

    def test_abort_by_rid_returns_partial_output(self, engine: LaunchedEngine) -> None:
        long = SamplingParams(max_new_tokens=800, temperature=1.0, ignore_eos=True)

        async def scenario() -> Any:
            task = asyncio.create_task(engine.client.generate(PROMPT, long, rid="abort-me"))
            await _wait_for(engine.client, lambda load: load["num_reqs"] >= 1)
            await engine.client.abort("abort-me")
            return await task

        gen = run(scenario())
        assert gen.finish_reason == "abort"
        assert len(gen.output_ids) < 800 and len(gen.output_ids) == len(gen.output_logprobs)

    def test_pause_holds_requests_until_continue(self, engine: LaunchedEngine) -> None:
        async def scenario() -> Any:
            await engine.client.pause(mode="in_place")
            try:
                task = asyncio.create_task(engine.client.generate(PROMPT, GREEDY))
                await _wait_for(engine.client, lambda load: load["num_waiting_reqs"] + load["num_reqs"] >= 1)
                await asyncio.sleep(0.5)  # observe: nothing completes while paused
                assert not task.done()
            finally:
                await engine.client.resume()
            return await task

        gen = run(scenario())
        assert gen.finish_reason == "length" and len(gen.output_ids) == GREEDY.max_new_tokens

    def test_weight_version_bump(self, engine: LaunchedEngine) -> None:
        async def scenario() -> tuple[str, Any]:
            before = await engine.client.weight_version()
            await engine.client.update_weight_version("contract-v7")
            version = await engine.client.weight_version()
            gen = await engine.client.generate(PROMPT, GREEDY)
            await engine.client.update_weight_version(before)
            return version, gen

        version, gen = run(scenario())
        assert version == "contract-v7" and gen.weight_version == "contract-v7"

    def test_update_from_disk_changes_outputs_and_restores(self, engine: LaunchedEngine,
                                                           model_dirs: tuple[str, str]) -> None:
        a_dir, b_dir = model_dirs

        async def scenario() -> tuple[Any, Any, Any, str]:
            before = await engine.client.generate(PROMPT, GREEDY)
            await engine.client.update_weights_from_disk(b_dir, "disk-b")
            during = await engine.client.generate(PROMPT, GREEDY)
            version = await engine.client.weight_version()
            await engine.client.update_weights_from_disk(a_dir, "disk-a")
            after = await engine.client.generate(PROMPT, GREEDY)
            return before, during, after, version

        before, during, after, version = run(scenario())
        assert version == "disk-b" and during.weight_version == "disk-b"
        assert during.output_logprobs != before.output_logprobs
        assert after.output_ids == before.output_ids
        assert max(abs(x - y) for x, y in zip(after.output_logprobs, before.output_logprobs, strict=True)) < 1e-5
        expected = hf_logprobs(b_dir, PROMPT + list(during.output_ids), len(PROMPT))
        assert max(abs(x - y) for x, y in zip(during.output_logprobs, expected, strict=True)) < tolerance(engine)

    def test_sleep_refuses_generation_and_wake_restores_the_probe_logprobs(self, engine: LaunchedEngine) -> None:
        from miles_lite.rollout.engine import MEMORY_TAGS, EngineError

        tokens = PROMPT + [7, 8, 9, 10, 300]

        async def scenario() -> tuple[list[float], list[float], list[str]]:
            before = await engine.client.score(tokens, len(PROMPT))
            refusals = []
            await engine.client.release_memory(list(MEMORY_TAGS))
            try:
                for call in (engine.client.generate(PROMPT, GREEDY), engine.client.score(tokens, len(PROMPT))):
                    with pytest.raises(EngineError, match="memory is released") as refused:
                        await call
                    refusals.append(str(refused.value))
                await engine.client.resume_memory(["weights"])
                with pytest.raises(EngineError, match="memory is released.*kv_cache"):
                    await engine.client.generate(PROMPT, GREEDY)
            finally:
                if engine.client.released:  # leave the module's shared engine awake, whatever failed
                    await engine.client.resume_memory([t for t in MEMORY_TAGS if t in engine.client.released])
            after = await engine.client.score(tokens, len(PROMPT))
            return before, after, refusals

        before, after, refusals = run(scenario())
        assert after == before, "the probe log-probs changed across sleep and wake"
        assert len(refusals) == 2
        assert run(engine.client.health(timeout_s=30.0))
        assert run(engine.client.generate(PROMPT, GREEDY)).finish_reason == "length"

    def test_update_from_missing_dir_raises(self, engine: LaunchedEngine, tmp_path: Any) -> None:
        from miles_lite.rollout.engine import EngineError

        with pytest.raises(EngineError, match="update_weights_from_disk"):
            run(engine.client.update_weights_from_disk(str(tmp_path / "nope"), "never"))
        assert run(engine.client.weight_version()) != "never"
