"""The push verifier asks each engine for probe scores only when it must, and still names a stale engine."""

from __future__ import annotations

import asyncio
import threading

import pytest

from miles_lite.weight_sync.plan import EngineSpec
from miles_lite.weight_sync.transport import EngineLoop, FleetEngine, WeightSyncError
from miles_lite.weight_sync.verify import ProbeBatch, PushVerifier

PROBE = ProbeBatch(sequences=((1, 2, 3), (4, 5, 6), (7, 8, 9)), prompt_lens=(1, 1, 1))


class ScoringEngine:
    """Scores every target token as `-level` and counts requests; the most in flight at once too."""

    def __init__(self, url: str, level: float) -> None:
        self.url = url
        self.level = level
        self.requests = 0
        self.in_flight = 0
        self.most_in_flight = 0

    async def score(self, input_ids: list[int], prompt_len: int) -> list[float]:
        self.requests += 1
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        await asyncio.sleep(0.01)
        self.in_flight -= 1
        return [-self.level] * (len(input_ids) - prompt_len)


@pytest.fixture()
def loop():
    ev = asyncio.new_event_loop()
    t = threading.Thread(target=ev.run_forever, daemon=True)
    t.start()
    yield EngineLoop(ev, timeout_s=10)
    ev.call_soon_threadsafe(ev.stop)
    t.join()


def test_verified_scores_stand_in_for_the_next_push_and_a_new_engine_is_asked_again(loop):
    trainer = {"level": 1.0}
    verifier = PushVerifier(loop, PROBE, lambda probe: [[-trainer["level"]] * 2 for _ in probe.sequences],
                            max_probe_logp_diff=0.1)
    engine = ScoringEngine("http://a:1", level=0.0)
    fleet = [FleetEngine(engine, EngineSpec("e0", 1))]

    verifier.before_push(fleet, "1")
    engine.level = 1.0  # the push landed
    verifier.verify(fleet, "1")
    assert engine.requests == 6  # before + after, three sequences each
    assert engine.most_in_flight == 3  # the probe's sequences go out together

    verifier.before_push(fleet, "2")  # the engine passed version 1: its scores then are its scores now
    assert engine.requests == 6
    trainer["level"] = 2.0
    engine.level = 2.0
    verifier.verify(fleet, "2")
    assert engine.requests == 9

    # A replacement under the same id is a new process: asked again, and a dropped update is named.
    replacement = ScoringEngine("http://a:2", level=0.5)
    fleet = [FleetEngine(replacement, EngineSpec("e0", 1))]
    verifier.before_push(fleet, "3")
    assert replacement.requests == 3
    trainer["level"] = 3.0
    with pytest.raises(WeightSyncError, match="e0: acknowledged version 3 but its probe logprobs are unchanged"):
        verifier.verify(fleet, "3")


def test_an_engine_scoring_nan_fails_verification(loop):
    # NaN compares false with any bound: an engine whose weights hold NaNs must not pass as "within it".
    verifier = PushVerifier(loop, PROBE, lambda probe: [[-1.0] * 2 for _ in probe.sequences], max_probe_logp_diff=0.1)
    fleet = [FleetEngine(ScoringEngine("http://a:1", level=float("nan")), EngineSpec("e0", 1))]
    with pytest.raises(WeightSyncError, match=r"e0: probe \|logp diff\| mean nan > weight_sync.max_probe_logp_diff"):
        verifier.verify(fleet, "1")


def test_trainer_scores_taken_ahead_serve_that_version_once(loop):
    calls: list[float] = []
    trainer = {"level": 1.0}

    def scores(probe: ProbeBatch) -> list[list[float]]:
        calls.append(trainer["level"])
        return [[-trainer["level"]] * 2 for _ in probe.sequences]

    verifier = PushVerifier(loop, PROBE, scores, max_probe_logp_diff=0.1)
    engine = ScoringEngine("http://a:1", level=1.0)
    fleet = [FleetEngine(engine, EngineSpec("e0", 1))]
    verifier.score_trainer("1")
    trainer["level"] = 5.0  # scores taken ahead are what the verification compares: not asked again
    assert verifier.verify(fleet, "1").logp_diff_mean == 0.0
    assert calls == [1.0]
    # Used once: the next verification of the same version asks the trainer again.
    with pytest.raises(WeightSyncError, match="mean 4 > weight_sync.max_probe_logp_diff"):
        verifier.verify(fleet, "1")
    assert calls == [1.0, 5.0]
    # Scores taken ahead for another version are not used (and are dropped).
    verifier.score_trainer("2")
    trainer["level"] = 1.0
    verifier.verify(fleet, "3")
    assert calls == [1.0, 5.0, 5.0, 1.0]
