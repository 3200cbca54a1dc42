"""Remote reward model: batches, retries with backoff, no completion scored twice or lost, a clear error
after the budget. Against a real HTTP server on loopback (the example plug-in package's reward server)."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from miles_plugins.reward_server import RewardServer  # noqa: E402

from miles_lite.rewards.batch import RewardBatch  # noqa: E402
from miles_lite.rewards.remote import RemoteReward, RemoteRewardError, RemoteRewardSpec  # noqa: E402


@pytest.fixture
def server_factory():
    servers = []

    def start(fail_first: int = 0) -> RewardServer:
        server = RewardServer(("127.0.0.1", 0), fail_first=fail_first)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def _call(reward: RemoteReward, completions: list[str], answers: list[float]) -> list[float]:
    n = len(completions)
    return reward(RewardBatch(completions, [float(a) for a in answers], ["q"] * n, [()] * n))


def test_scores_every_completion_once_in_order_across_batches(server_factory):
    server = server_factory()
    completions = [f"so the answer is {i}" for i in range(10)]
    answers = [float(i if i % 3 else -1) for i in range(10)]
    reward = RemoteReward(RemoteRewardSpec(server.url, batch_size=3, max_concurrency=3))
    scores = _call(reward, completions, answers)
    assert scores == [0.0 if i % 3 == 0 else 1.0 for i in range(10)]
    assert reward.requests == 4  # ceil(10 / 3) batches
    assert len(server.scored_ids) == 10 and len(set(server.scored_ids)) == 10


def test_failed_batches_are_retried_with_backoff_and_nothing_is_scored_twice(server_factory):
    server = server_factory(fail_first=2)
    waits: list[float] = []
    reward = RemoteReward(RemoteRewardSpec(server.url, batch_size=4, retries=3, backoff_s=0.1, max_concurrency=1),
                          sleep=waits.append)
    scores = _call(reward, ["1", "2", "3", "4", "5"], [1, 2, 0, 4, 0])
    assert scores == [1.0, 1.0, 0.0, 1.0, 0.0]
    assert reward.retries == 2 and waits == [0.1, 0.2]
    assert sorted(server.scored_ids) == sorted(set(server.scored_ids)) and len(server.scored_ids) == 5


def test_budget_exhausted_names_the_service_and_the_fix(server_factory):
    server = server_factory(fail_first=100)
    reward = RemoteReward(RemoteRewardSpec(server.url, retries=1, backoff_s=0.0), sleep=lambda s: None)
    with pytest.raises(RemoteRewardError, match=r"failed batch 0 .* 2 times.*HTTP 503.*rewards.remote.retries"):
        _call(reward, ["1"], [1])


def test_unreachable_service_raises_after_retries():
    reward = RemoteReward(RemoteRewardSpec("http://127.0.0.1:9/score", retries=2, timeout_s=1.0),
                          sleep=lambda s: None)
    with pytest.raises(RemoteRewardError, match="3 times"):
        _call(reward, ["x"], [0])
    assert reward.requests == 3
