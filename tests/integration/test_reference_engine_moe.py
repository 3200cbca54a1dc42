"""The reference engine on a tiny Qwen3-MoE: SGLang's `routed_experts` and per-expert weight updates."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import torch
from trainer_harness import make_test_checkpoint

from miles_lite.engines.reference.model import ReferenceModel
from miles_lite.engines.reference.routing import decode_routed
from miles_lite.engines.reference.sampling import RequestSampling
from miles_lite.engines.reference.scheduler import GenRequest, Scheduler


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_test_checkpoint("qwen3_moe", tmp_path_factory.mktemp("moe") / "m"))


def _generate(model: ReferenceModel, prompts: list[list[int]], routed: bool, n: int = 12) -> list[dict]:
    async def run() -> list[dict]:
        sched = Scheduler(model, 8, lambda: "v0")
        sched.start()
        try:
            reqs = [GenRequest(rid=f"r{i}", input_ids=p, sampling=RequestSampling(max_new_tokens=n, temperature=0.0,
                                                                                   ignore_eos=True),
                               return_logprob=True, logprob_start_len=-1, return_routed_experts=routed,
                               future=asyncio.get_running_loop().create_future()) for i, p in enumerate(prompts)]
            return list(await asyncio.gather(*(sched.submit(r) for r in reqs)))
        finally:
            await sched.close()
    return asyncio.run(run())


def test_routed_experts_are_the_routers_choices_at_every_position_run(moe_dir: str) -> None:
    from transformers import AutoModelForCausalLM

    model = ReferenceModel(moe_dir)
    prompts = [[5, 9, 13], [7, 1, 2, 3, 4, 200, 17]]  # batched: left padding must not shift rows
    answers = _generate(model, prompts, routed=True)
    hf = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()
    for prompt, answer in zip(prompts, answers, strict=True):
        seq = prompt + answer["output_ids"]
        ids = decode_routed(answer["meta_info"]["routed_experts"], 3, 2)
        assert ids.shape == (len(seq) - 1, 3, 2)
        with torch.no_grad():
            logits = hf(torch.tensor([seq[:-1]]), output_router_logits=True).router_logits
        assert not ids[:, 0].any()  # layer 0 is dense (mlp_only_layers)
        for layer, lg in zip((1, 2), logits, strict=True):
            want = lg.reshape(len(seq) - 1, -1).topk(2).indices.sort(-1).values.numpy()
            assert np.array_equal(np.sort(ids[:, layer], axis=-1), want)
    plain = _generate(model, prompts, routed=False)
    assert all("routed_experts" not in a["meta_info"] for a in plain)
    assert [a["output_ids"] for a in plain] == [a["output_ids"] for a in answers]


def test_per_expert_names_load_into_the_stacked_experts(moe_dir: str) -> None:
    model = ReferenceModel(moe_dir)
    name = "model.layers.2.mlp.experts.5.up_proj.weight"
    new = torch.randn(32, 64)
    assert model.load_named_tensors([(name, new), ("model.layers.1.mlp.experts.0.down_proj.weight",
                                                   torch.zeros(64, 32))]) == 2
    stacked = dict(model.model.named_parameters())
    assert torch.equal(stacked["model.layers.2.mlp.experts.gate_up_proj"][5, 32:], new)
    assert not stacked["model.layers.1.mlp.experts.down_proj"][0].any()
    assert torch.equal(torch.tensor(model.get_weights_by_name(name)), new)
    with pytest.raises(ValueError, match="shape mismatch"):
        model.load_named_tensors([(name, torch.zeros(3, 3))])


def test_dense_model_refuses_nothing_and_returns_no_routing(tmp_path: Path) -> None:
    path = make_test_checkpoint("qwen2", tmp_path / "d")
    model = ReferenceModel(str(path))
    assert model.routing is None
    assert "routed_experts" not in _generate(model, [[1, 2, 3]], routed=False, n=2)[0]["meta_info"]
