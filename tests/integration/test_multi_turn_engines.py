"""Multi-turn tool rollouts against real engine servers (the reference engine on CPU, stock SGLang on a GPU).

What only a real server shows: a stop string ends the model's turn (SGLang matches stop strings on decoded
text, so it runs with its tokenizer: `skip_tokenizer_init=false`), the turn's ids come back untrimmed, the
environment's reply is appended as ids, and the next request continues from exactly the ids produced so far.
The engine then scores every trajectory in one pass: its log-probs of the model's tokens must equal the ones
the rollout recorded, which holds only if every turn was sampled from that very token context.

A random tiny model seldom writes a calculator call, so the environment here ends a turn at a frequent
character; the calculator's own parsing is tested in tests/unit/test_multi_turn.py.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from engine_contract import ENGINE_KINDS, shipped_sglang_args

from miles_lite.config.schema import FaultToleranceConfig, RolloutConfig, TinyModelShape
from miles_lite.data.tokenizer import load_or_build_tokenizer
from miles_lite.engines.launcher import EngineLauncher
from miles_lite.rollout.fleet import EngineFleet, EngineHandle
from miles_lite.rollout.manager import RolloutManager
from miles_lite.rollout.prompt_spec import PromptSpec
from miles_lite.trainer.tiny_hf import make_tiny_hf_model

# head_dim 64: SGLang's precompiled RoPE kernels cover 64/128/256/512 only.
SHAPE = TinyModelShape(hidden_size=256, ffn_hidden_size=512, num_layers=2, num_attention_heads=4, num_kv_heads=2,
                       max_position_embeddings=1024)
REPLY = " = 1 ; "
# Largest |scored - sampled| log-prob of a model token: SGLang runs bf16 (its fused RMSNorm kernel has no
# float32 path) and rounds differently between decode and a one-pass prefill.
TOL = {"reference": 1e-4, "sglang": 0.1}


class FrequentTool:
    """Ends a model turn at the letter "e" and answers with a fixed text."""

    stop = ("e",)

    def reply(self, turn: str, question: str) -> str | None:
        return REPLY if "e" in turn else None


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("multi-turn-model")
    model = make_tiny_hf_model("qwen2", SHAPE, 512, root / "model", seed=3)
    # Stop strings need the engine's tokenizer: the offline tokenizer goes beside the weights.
    load_or_build_tokenizer(root / "tokenizers", vocab_size=512, seed=0).save_pretrained(str(model))
    return Path(model)


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


@pytest.mark.parametrize("kind", ENGINE_KINDS)
def test_tool_turns_continue_from_the_exact_ids_on_a_real_engine(kind: str, model_dir: Path, tokenizer,
                                                                 tmp_path: Path):
    rollout = RolloutConfig(backend=kind, engines=1, engine_tp=1, startup_timeout_s=600.0, request_timeout_s=120.0,
                            group_size=4, max_new_tokens=40, max_turns=4, temperature=1.0,
                            reference_args={"max_batch_size": 32, "threads": 1},
                            # The shipped defaults (they must start on this shape), with the tokenizer on.
                            sglang_args={**shipped_sglang_args(), "skip_tokenizer_init": False,
                                         "mem_fraction_static": 0.3, "dtype": "bfloat16"})
    ft = FaultToleranceConfig(health_interval_s=60, request_retries=0)

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids)

    async def main():
        launcher = EngineLauncher(rollout, str(model_dir), str(tmp_path / "logs"))
        launched = await launcher.start(0)
        fleet = EngineFleet(ft)
        try:
            await fleet.add_engine(EngineHandle(launched.client))
            manager = RolloutManager(fleet, rollout, ft, decode=decode, encode=encode, environment=FrequentTool(),
                                     seed=0)
            prompts = [PromptSpec(i, tuple(encode(q)), q, q, 0.0, ()) for i, q in enumerate(
                ["what is two times three", "add seven and five"])]
            groups = await manager.generate_groups(prompts)
            samples = [s for g in groups for s in g.samples]
            scores = [await launched.client.score(s.prompt_ids + s.response_ids, len(s.prompt_ids)) for s in samples]
            return samples, scores
        finally:
            await fleet.close()
            await launcher.stop(launched)

    samples, scores = asyncio.run(main())
    reply_ids = encode(REPLY)
    multi = [s for s in samples if s.turns >= 2]
    assert multi, f"no trajectory called the tool: {[s.response_text for s in samples]}"
    for sample, scored in zip(samples, scores, strict=True):
        mask = sample.loss_mask or [1] * len(sample.response_ids)
        assert len(mask) == len(sample.response_ids) == len(sample.rollout_logprobs) == len(scored)
        # Replies: exactly the reply's ids, masked, no log-prob; each follows a turn that ended at the stop string.
        i, turns = 0, 0
        while i < len(mask):
            j = i
            while j < len(mask) and mask[j] == mask[i]:
                j += 1
            if mask[i] == 0:
                assert sample.response_ids[i:j] == reply_ids and set(sample.rollout_logprobs[i:j]) == {0.0}
                assert "e" in decode(sample.response_ids[:i])[-8:]
            else:
                turns += 1
                diffs = [abs(a - b) for a, b in zip(sample.rollout_logprobs[i:j], scored[i:j], strict=True)]
                assert max(diffs) < TOL[kind], (sample.response_text, max(diffs))
            i = j
        assert turns == sample.turns
