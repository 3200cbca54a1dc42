"""LoRA serving through SGLang's API on every engine kind (`engine_contract.ENGINE_KINDS`: the reference engine,
and a stock SGLang server where sglang is importable and a CUDA GPU is present): `/load_lora_adapter`,
`lora_path` per request (base and adapter rows in one batch), `/unload_lora_adapter`; a real server process on
a tiny Qwen2, started with the LoRA flags a run derives from `trainer.lora`. The probe's claim: the engine's
log-probs with an adapter equal an HF forward of the base with that adapter merged (`LOGPROB_TOL` per kind)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from engine_contract import (  # noqa: E402
    ENGINE_KINDS,
    GREEDY,
    PROMPT,
    hf_logprobs,
    run,
    running_engine,
    save_tiny_qwen2,
    tolerance,
)

from miles_lite.config.lora_serving import with_lora_serving  # noqa: E402
from miles_lite.config.schema import MilesConfig  # noqa: E402
from miles_lite.formats.lora import (  # noqa: E402
    TARGETS,
    LoraSpec,
    adapter_payload,
    merged_state,
    save_adapter_dir,
    tensor_name,
)
from miles_lite.rollout.engine import EngineError  # noqa: E402
from miles_lite.rollout.http_client import HttpEngine  # noqa: E402
from miles_lite.trainer.hf_convert import read_hf_state, save_hf_checkpoint  # noqa: E402

SPEC = LoraSpec(4, 8.0, 0.0, TARGETS)
TOKENS = [3, 17, 99, 250, 7, 42, 300, 11, 5, 64]


def _adapter(base: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for layer in range(2):
        for target in TARGETS:
            path = {"o_proj": "self_attn", "q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn"}.get(
                target, "mlp")
            out_f, in_f = base[f"model.layers.{layer}.{path}.{target}.weight"].shape
            out[tensor_name(layer, target, "A")] = 0.2 * torch.randn(SPEC.rank, in_f, generator=gen)
            out[tensor_name(layer, target, "B")] = 0.2 * torch.randn(out_f, SPEC.rank, generator=gen)
    return out


def _lora_engine_args(kind: str, max_rank: int) -> dict[str, dict]:
    """The engine flags a run with `trainer.lora.rank=max_rank` on every projection starts `kind` with."""
    cfg = MilesConfig()
    cfg.rollout.backend = kind
    cfg.trainer.lora.rank, cfg.trainer.lora.alpha = max_rank, 2.0 * max_rank
    served = with_lora_serving(cfg).rollout
    return {"reference_args": dict(served.reference_args), "sglang_args": dict(served.sglang_args)}


@pytest.mark.parametrize("kind", ENGINE_KINDS)
def test_adapters_load_serve_per_request_and_unload(kind: str, tmp_path: Path) -> None:
    model = save_tiny_qwen2(str(tmp_path / "base"), seed=0)
    base = read_hf_state(model)
    config = (Path(model) / "config.json").read_text()
    wants, merged = {}, {}
    for i in (1, 2):
        adapter = _adapter(base, seed=i)
        save_adapter_dir(tmp_path / f"adapter{i}", adapter, SPEC, model)
        merged[f"v{i}"] = str(save_hf_checkpoint(merged_state(base, adapter, SPEC), json.loads(config),
                                                 tmp_path / f"merged{i}"))
        wants[f"v{i}"] = hf_logprobs(merged[f"v{i}"], TOKENS, 2)
    wants[None] = hf_logprobs(model, TOKENS, 2)

    with running_engine(kind, model, str(tmp_path / "logs"), **_lora_engine_args(kind, 8)) as launched:
        client = launched.client
        tol = tolerance(launched)

        async def scenario() -> None:
            answer = await client.load_lora_adapter("v1", str(tmp_path / "adapter1"))
            assert answer["loaded_adapters"] == {"v1": str(tmp_path / "adapter1")}
            await client.load_lora_adapter("v2", str(tmp_path / "adapter2"))
            # One client per adapter choice, all requests in flight together: the engine batches their rows.
            clients = {}
            for name in (None, "v1", "v2"):
                clients[name] = HttpEngine(f"c-{name}", client.url)
                clients[name].lora_name = name
            got = await asyncio.gather(*(c.score(TOKENS, 2) for c in clients.values() for _ in range(2)))
            for (name, _), scores in zip([(n, k) for n in clients for k in range(2)], got, strict=True):
                diff = max(abs(a - b) for a, b in zip(scores, wants[name], strict=True))
                assert diff < tol, (name, diff)
            assert max(abs(a - b) for a, b in zip(wants["v1"], wants[None], strict=True)) > 1e-2
            # Sampling with the adapter: the log-probs it reports are the merged model's.
            gen = await clients["v2"].generate(PROMPT, GREEDY)
            expected = hf_logprobs(merged["v2"], PROMPT + list(gen.output_ids), len(PROMPT))
            assert max(abs(a - b) for a, b in zip(gen.output_logprobs, expected, strict=True)) < tol
            # Unloaded and gone from disk (a push deletes the directories of versions no longer served):
            # requests naming it fail. (SGLang reloads an unloaded adapter a request names while its files remain.)
            await client.unload_lora_adapter("v1")
            shutil.rmtree(tmp_path / "adapter1")
            with pytest.raises(EngineError, match="v1"):
                await clients["v1"].score(TOKENS, 2)
            with pytest.raises(EngineError, match="max-lora-rank"):
                big = LoraSpec(16, 8.0, 0.0, ("q_proj",))
                save_adapter_dir(tmp_path / "big", {tensor_name(0, "q_proj", "A"): torch.zeros(16, 64),
                                                    tensor_name(0, "q_proj", "B"): torch.zeros(64, 16)}, big, model)
                await client.load_lora_adapter("big", str(tmp_path / "big"))
            for c in clients.values():
                await c.close()
            await client.close()

        run(scenario())


@pytest.mark.parametrize("kind", ENGINE_KINDS)
def test_an_adapter_sent_as_tensors_serves_like_its_merged_model(kind: str, tmp_path: Path) -> None:
    """`/load_lora_adapter_from_tensors` (`weight_sync.lora=tensors`): the payload the push sends, nothing on disk."""
    model = save_tiny_qwen2(str(tmp_path / "base"), seed=0)
    base = read_hf_state(model)
    adapter = _adapter(base, seed=3)
    merged = str(save_hf_checkpoint(merged_state(base, adapter, SPEC), json.loads((Path(model) / "config.json")
                                                                                  .read_text()), tmp_path / "merged"))
    want = hf_logprobs(merged, TOKENS, 2)

    with running_engine(kind, model, str(tmp_path / "logs"), **_lora_engine_args(kind, 8)) as launched:
        client = launched.client

        async def scenario() -> None:
            payloads = [adapter_payload(adapter)]  # one per engine TP rank (engine_tp=1 here)
            answer = await client.load_lora_adapter_from_tensors("t1", SPEC.peft_config(model), payloads)
            assert "t1" in answer["loaded_adapters"]
            user = HttpEngine("c-t1", client.url)
            user.lora_name = "t1"
            scores = await user.score(TOKENS, 2)
            assert max(abs(a - b) for a, b in zip(scores, want, strict=True)) < tolerance(launched)
            # A second version under a new name while the first serves, then the first unloaded: a push's steps.
            await client.load_lora_adapter_from_tensors("t2", SPEC.peft_config(model), payloads)
            await client.unload_lora_adapter("t1")
            user.lora_name = "t2"
            assert max(abs(a - b) for a, b in zip(await user.score(TOKENS, 2), want, strict=True)) < tolerance(launched)
            with pytest.raises(EngineError, match="t2"):  # a name in service is not loaded over
                await client.load_lora_adapter_from_tensors("t2", SPEC.peft_config(model), payloads)
            await user.close()
            await client.close()

        run(scenario())


def test_a_tensor_payload_runs_nothing_but_tensors(tmp_path: Path) -> None:
    """The reference engine unpickles adapter payloads with tensors only: a payload naming any other callable
    is refused before anything of it runs."""
    import base64
    import pickle

    class Boom:
        def __reduce__(self) -> tuple:
            return (os.system, ("touch " + str(tmp_path / "ran"),))

    model = save_tiny_qwen2(str(tmp_path / "base"), seed=0)
    with running_engine("reference", model, str(tmp_path / "logs"), **_lora_engine_args("reference", 8)) as launched:
        client = launched.client
        evil = base64.b64encode(pickle.dumps({tensor_name(0, "q_proj", "A"): Boom()})).decode()
        with pytest.raises(EngineError, match="tensors only, not posix.system"):
            run(client.load_lora_adapter_from_tensors("x", SPEC.peft_config(model), [evil]))
        run(client.close())
    assert not (tmp_path / "ran").exists()


def test_lora_path_needs_enable_lora(tmp_path: Path) -> None:
    model = save_tiny_qwen2(str(tmp_path / "base"), seed=0)
    with running_engine("reference", model, str(tmp_path / "logs")) as launched:
        client = launched.client
        client.lora_name = "v1"
        with pytest.raises(EngineError, match="--enable-lora"):
            run(client.score(TOKENS, 2))
