"""The reference scheduler's decode bursts change how often the model thread returns to the event loop, not what
is generated: the same seeded requests give the same tokens and log-probs one step per call and in bursts, with
min_new_tokens, token budgets and stop strings; a request submitted mid-burst is taken at the next step."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from miles_lite.config.schema import TinyModelShape
from miles_lite.engines.reference import scheduler as sched
from miles_lite.engines.reference.model import ReferenceModel
from miles_lite.engines.reference.sampling import RequestSampling
from miles_lite.engines.reference.scheduler import GenRequest, Scheduler
from miles_lite.trainer.tiny_hf import make_tiny_hf_model


class Decoder:
    """Decodes one token (the id) as one character, so stop strings can be matched."""

    def decode(self, ids):
        return "".join(chr(97 + i % 26) for i in ids)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> ReferenceModel:
    path = make_tiny_hf_model("qwen2", TinyModelShape(), 512, Path(tmp_path_factory.mktemp("m")) / "model", seed=3)
    return ReferenceModel(str(path))


def _requests(loop: asyncio.AbstractEventLoop, tag: str) -> list[GenRequest]:
    specs = [{"max_new_tokens": 9, "temperature": 1.0, "sampling_seed": 7},
             {"max_new_tokens": 5, "temperature": 1.0, "sampling_seed": 8, "min_new_tokens": 4},
             {"max_new_tokens": 12, "temperature": 0.0},
             {"max_new_tokens": 12, "temperature": 1.0, "sampling_seed": 9, "stop": ["q"]},
             {"max_new_tokens": 16, "temperature": 0.7, "top_p": 0.9, "sampling_seed": 10}]
    return [GenRequest(f"{tag}{i}", [3 + i, 40, 77, 200 + i], RequestSampling.from_json(spec, 512), True, -1,
                       loop.create_future()) for i, spec in enumerate(specs)]


def _generate(model: ReferenceModel, burst: int, monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    monkeypatch.setattr(sched, "DECODE_BURST", burst)

    async def run() -> list[tuple]:
        loop = asyncio.get_running_loop()
        scheduler = Scheduler(model, 8, lambda: "v", tokenizer=Decoder())
        scheduler.start()
        try:
            first = _requests(loop, "a")
            pending = [asyncio.ensure_future(scheduler.submit(r)) for r in first]
            await asyncio.sleep(0.01)  # one joins while the others decode
            late = _requests(loop, "b")[:1]
            pending.append(asyncio.ensure_future(scheduler.submit(late[0])))
            outs = await asyncio.gather(*pending)
        finally:
            await scheduler.close()
        return [(tuple(o["output_ids"]), tuple(lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]),
                 o["meta_info"]["finish_reason"]["type"]) for o in outs]

    return asyncio.run(run())


def test_bursts_generate_what_single_steps_generate(model: ReferenceModel, monkeypatch: pytest.MonkeyPatch) -> None:
    single = _generate(model, 1, monkeypatch)
    burst = _generate(model, 64, monkeypatch)
    # Tokens and finish reasons match exactly; log-probs to float32 rounding, since the late request can join at a
    # different step and so share a batch of another size (another matmul blocking) with the others.
    assert [(ids, reason) for ids, _, reason in burst] == [(ids, reason) for ids, _, reason in single]
    for (_, got, _), (_, want, _) in zip(burst, single, strict=True):
        assert got == pytest.approx(want, abs=1e-4)
    assert len(single[1][0]) >= 4 and len(single[0][0]) <= 9
