"""What SGLang engines of a colocated hand-off run are started with (`config.colocation`), and the client's
guards around SGLang's memory saver endpoints (which stop the server on a misuse instead of answering)."""

from __future__ import annotations

import asyncio
import logging

import pytest
from aiohttp import web

from miles_lite.config.colocation import (
    engine_rollout,
    expandable_segments,
    handoff_problems,
    memory_saver_env,
    memory_saver_on,
)
from miles_lite.config.compose import load_config
from miles_lite.config.schema import MilesConfig
from miles_lite.engines.launcher import EngineLauncher
from miles_lite.rollout.engine import EngineError
from miles_lite.rollout.http_client import HttpEngine
from tests.unit.local_http import serve_routes

HANDOFF = ["rollout=sglang", "cluster.placement=colocated"]


def _cfg(*overrides: str) -> MilesConfig:
    return load_config(list(overrides))


def test_handoff_runs_start_sglang_with_the_memory_saver(tmp_path) -> None:
    cfg = _cfg(*HANDOFF)
    rollout = engine_rollout(cfg)
    assert rollout.sglang_args["enable_memory_saver"] is True and memory_saver_on(rollout)
    # The user's other flags stay as they are; the run's config itself is not changed.
    assert {k: v for k, v in rollout.sglang_args.items() if k != "enable_memory_saver"} == cfg.rollout.sglang_args
    assert "enable_memory_saver" not in cfg.rollout.sglang_args
    cmd = EngineLauncher(rollout, str(tmp_path), str(tmp_path / "logs"),
                         env={"PYTHONPATH": str(tmp_path / "none")}).command_factory(0)(40000, None)
    assert cmd.count("--enable-memory-saver") == 1
    # Neither a host copy of the weights (every push loads them) nor graph memory through the saver.
    assert "--enable-weights-cpu-backup" not in cmd
    assert handoff_problems(cfg) == []


@pytest.mark.parametrize("overrides", [
    ["rollout=sglang", "cluster.placement=colocated", "cluster.colocated_memory=resident"],
    ["rollout=sglang"],  # disaggregated
    ["cluster.placement=colocated"],  # reference engines free their memory without a flag
])
def test_other_runs_start_engines_as_configured(overrides: list[str]) -> None:
    cfg = _cfg(*overrides)
    assert engine_rollout(cfg) is cfg.rollout and not memory_saver_on(cfg.rollout)
    assert handoff_problems(cfg) == []


@pytest.mark.parametrize("key", ["enable_memory_saver", "enable-memory-saver"])
def test_an_explicit_true_in_either_spelling_is_one_flag(key: str) -> None:
    cfg = _cfg(*HANDOFF, f"+rollout.sglang_args.{key}=true")
    assert handoff_problems(cfg) == []
    assert engine_rollout(cfg).sglang_args.get(key.replace("-", "_")) is True
    assert [k for k in engine_rollout(cfg).sglang_args if "memory" in k] == ["enable_memory_saver"]


@pytest.mark.parametrize("key", ["enable_memory_saver", "enable-memory-saver"])
def test_the_memory_saver_turned_off_in_a_handoff_run_is_an_error(key: str) -> None:
    problems = handoff_problems(_cfg(*HANDOFF, f"+rollout.sglang_args.{key}=false"))
    assert len(problems) == 1
    assert "rollout.sglang_args.enable_memory_saver=False" in problems[0]
    assert "cluster.colocated_memory=resident" in problems[0] and "remove the setting" in problems[0]
    # Off is fine when the engines keep their memory.
    assert handoff_problems(_cfg(*HANDOFF, f"+rollout.sglang_args.{key}=false",
                                 "cluster.colocated_memory=resident")) == []


def test_expandable_segments_in_the_engines_env_is_an_error() -> None:
    env = "+rollout.engine_env.PYTORCH_CUDA_ALLOC_CONF"
    problems = handoff_problems(_cfg(*HANDOFF, f"{env}='expandable_segments:True'"))
    assert len(problems) == 1 and "rollout.engine_env.PYTORCH_CUDA_ALLOC_CONF" in problems[0]
    assert handoff_problems(_cfg(*HANDOFF, f"{env}='max_split_size_mb:128'")) == []


def test_sglang_weight_cache_in_a_handoff_run_is_an_error() -> None:
    problems = handoff_problems(_cfg(*HANDOFF, "+rollout.sglang_args.weight_cache_mode=daemon"))
    assert len(problems) == 1 and "rollout.sglang_args.weight_cache_mode='daemon'" in problems[0]
    assert handoff_problems(_cfg(*HANDOFF, "+rollout.sglang_args.weight_cache_mode=off")) == []


def test_memory_saver_env_drops_only_expandable_segments() -> None:
    assert expandable_segments("max_split_size_mb:64, expandable_segments:True")
    assert not expandable_segments("expandable_segments:False")
    env = {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64,expandable_segments:True",
           "PYTORCH_ALLOC_CONF": "expandable_segments:True", "OTHER": "x"}
    assert memory_saver_env(env) == {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64", "OTHER": "x"}
    assert memory_saver_env({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}) == {
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}


def test_engines_with_the_memory_saver_start_without_expandable_segments(tmp_path, monkeypatch, caplog) -> None:
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    rollout = engine_rollout(_cfg(*HANDOFF))
    with caplog.at_level(logging.WARNING):
        proc = EngineLauncher(rollout, str(tmp_path), str(tmp_path / "logs"),
                              env={"PYTHONPATH": str(tmp_path / "none")}).create(0)
    assert proc._env is not None and "PYTORCH_CUDA_ALLOC_CONF" not in proc._env
    assert "without expandable_segments" in caplog.text
    # Engines without the memory saver keep the environment as it is.
    plain = EngineLauncher(_cfg("rollout=sglang").rollout, str(tmp_path), str(tmp_path / "logs"),
                           env={"PYTHONPATH": str(tmp_path / "none")}).create(0)
    assert plain._env is not None and plain._env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"


class _MemoryServer:
    """Answers as SGLang does (200, body null); records the memory calls; holds /generate until released."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, list[str]]] = []
        self.hold = asyncio.Event()
        self.probe_hold = asyncio.Event()
        self.probe_seen = asyncio.Event()
        self.runner: web.AppRunner | None = None

    async def start(self) -> str:
        async def memory(request: web.Request) -> web.Response:
            self.calls.append((request.path, (await request.json())["tags"]))
            return web.Response(text="null", content_type="application/json")

        async def generate(request: web.Request) -> web.Response:
            await self.hold.wait()
            return web.json_response({"output_ids": [1], "meta_info": {
                "output_token_logprobs": [[-0.5, 1, None]], "finish_reason": {"type": "length"}}})

        async def health(request: web.Request) -> web.Response:
            self.calls.append((request.path, []))
            self.probe_seen.set()
            await self.probe_hold.wait()
            return web.Response(text="")

        self.runner, url = await serve_routes({
            ("GET", "/health_generate"): health, ("POST", "/release_memory_occupation"): memory,
            ("POST", "/resume_memory_occupation"): memory, ("POST", "/generate"): generate})
        return url


def test_the_client_sends_only_what_sglang_can_take() -> None:
    from miles_lite.types import SamplingParams

    async def scenario() -> list[tuple[str, list[str]]]:
        server = _MemoryServer()
        client = HttpEngine("sglang-0", await server.start())
        try:
            with pytest.raises(EngineError, match=r"\['weights'\] not released by this client"):
                await client.resume_memory(["weights"])
            # A release with a request of the client in flight (SGLang's scheduler asserts it is idle).
            task = asyncio.create_task(client.generate([1, 2], SamplingParams(max_new_tokens=1)))
            while client.inflight == 0:
                await asyncio.sleep(0.01)
            with pytest.raises(EngineError, match="1 request\\(s\\) in flight"):
                await client.release_memory(["kv_cache"])
            server.hold.set()
            await task
            assert client.inflight == 0
            await client.release_memory(["cuda_graph", "weights", "kv_cache", "weights"])
            with pytest.raises(EngineError, match=r"\['kv_cache'\] already released"):
                await client.release_memory(["kv_cache"])
            with pytest.raises(ValueError, match="non-empty subset"):
                await client.resume_memory([])
            # Nothing reads or writes released weights (SGLang would touch unmapped memory).
            for call in (client.update_weights_from_tensor(["x"], "direct", "v1"),
                         client.update_weights_from_disk("/m", "v1"), client.get_weights_by_name("w"),
                         client.update_weights_from_distributed(["w"], ["bfloat16"], [[1]], "g", "v1")):
                with pytest.raises(EngineError, match="weights are released"):
                    await call
            await client.resume_memory(["weights"])
            await client.resume_memory(["kv_cache", "cuda_graph"])
            assert client.released == set()
            return server.calls
        finally:
            await client.close()
            assert server.runner is not None
            await server.runner.cleanup()

    calls = asyncio.run(scenario())
    # Refused calls never reached the server; tags go in SGLang's constant order, without repeats.
    assert calls == [("/release_memory_occupation", ["weights", "kv_cache", "cuda_graph"]),
                     ("/resume_memory_occupation", ["weights"]),
                     ("/resume_memory_occupation", ["kv_cache", "cuda_graph"])]


def test_a_release_waits_for_the_health_probes_in_flight_and_refuses_new_ones() -> None:
    from miles_lite.types import SamplingParams

    async def scenario() -> tuple[list[tuple[str, list[str]]], bool]:
        server = _MemoryServer()
        client = HttpEngine("sglang-0", await server.start())
        try:
            probe = asyncio.create_task(client.health(30.0))
            await server.probe_seen.wait()
            release = asyncio.create_task(client.release_memory(["kv_cache", "weights"]))
            # The release waits for the probe's answer (SGLang's probe runs a generation) ...
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(asyncio.shield(release), 0.3)
            assert server.calls == [("/health_generate", [])]
            # ... and meanwhile new probes and generations are refused without reaching the engine.
            assert await client.health(30.0) is False
            with pytest.raises(EngineError, match="memory is released"):
                await client.generate([1, 2], SamplingParams(max_new_tokens=1))
            server.probe_hold.set()
            healthy = await probe
            await release
            assert client.released == {"kv_cache", "weights"} and await client.health(30.0) is False
            return server.calls, healthy
        finally:
            await client.close()
            assert server.runner is not None
            await server.runner.cleanup()

    calls, healthy = asyncio.run(scenario())
    assert healthy is True
    assert calls == [("/health_generate", []), ("/release_memory_occupation", ["weights", "kv_cache"])]
