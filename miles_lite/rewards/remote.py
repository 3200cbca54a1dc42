"""Rewards from a reward model behind HTTP, usable beside the rule-based rewards with its own weight.

Protocol (JSON over ``POST <url>``), one request per batch of completions::

    request:  {"ids": ["<run>-<n>", ...], "completions": [...], "questions": [...],
               "answers": [...], "steps": [[...], ...],
               "prompts": [...], "labels": [...], "sources": [...], "columns": {"<column>": [...], ...}}

`answers` are the labels as numbers (null when a label is not one); `prompts`, `labels` and `columns`
are the records' prompts (a string or chat messages), labels and every column, as the data has them.
    response: {"scores": [float, ...]}            # same length and order as "ids"
              optionally "ids": [...]              # if present, must equal the request's ids

Every completion gets exactly one score: batches are disjoint, a failed batch is sent again with the
same ids (a server may use them to answer a repeat from its cache instead of scoring twice) and its
answer replaces nothing already scored. A batch that fails ``retries + 1`` times raises
:class:`RemoteRewardError` naming the service, the batch and the last error.
"""

from __future__ import annotations

import itertools
import json
import math
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from miles_lite.rewards.batch import RewardBatch


class RemoteRewardError(RuntimeError):
    """The reward service did not answer a batch usefully within the retry budget."""


@dataclass(frozen=True)
class RemoteRewardSpec:
    """Where the service is and how hard to try."""

    url: str
    # Name of its column in the rollout table and metrics, its weight in the total, its largest score.
    name: str = "remote"
    weight: float = 1.0
    max_score: float = 1.0
    batch_size: int = 32
    timeout_s: float = 30.0
    retries: int = 3
    backoff_s: float = 0.5
    max_concurrency: int = 4


class RemoteReward:
    """A reward function of the `batch` convention (`rewards.batch`) backed by HTTP."""

    def __init__(self, spec: RemoteRewardSpec, *, sleep=time.sleep) -> None:
        self.spec = spec
        self._ids = itertools.count()
        self._sleep = sleep
        # Counters for metrics and tests: requests sent, retries made.
        self.requests = 0
        self.retries = 0

    def __call__(self, batch: RewardBatch) -> list[float]:
        completions = batch.completions
        n = len(completions)
        ids = [f"c{next(self._ids)}" for _ in range(n)]
        size = max(1, self.spec.batch_size)
        batches = [range(start, min(start + size, n)) for start in range(0, n, size)]

        def payload(rows: range) -> dict:
            answers = [batch.answers[i] for i in rows]
            return {"ids": [ids[i] for i in rows], "completions": [completions[i] for i in rows],
                    "questions": [batch.questions[i] for i in rows],
                    "answers": [None if math.isnan(a) else float(a) for a in answers],
                    "steps": [[float(x) for x in batch.steps[i]] for i in rows],
                    "prompts": [batch.prompts[i] for i in rows], "labels": [batch.labels[i] for i in rows],
                    "sources": [batch.sources[i] for i in rows],
                    "columns": {k: [v[i] for i in rows] for k, v in batch.columns.items()}}

        scores: list[float | None] = [None] * n
        workers = max(1, min(self.spec.max_concurrency, len(batches)))
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="remote-reward") as pool:
            futures = [(rows, pool.submit(self._score_batch, index, payload(rows)))
                       for index, rows in enumerate(batches)]
            for rows, future in futures:
                for i, value in zip(rows, future.result(), strict=True):
                    scores[i] = value
        assert all(s is not None for s in scores)
        return [float(s) for s in scores]  # type: ignore[arg-type]

    def _score_batch(self, index: int, body: dict) -> list[float]:
        last = ""
        for attempt in range(self.spec.retries + 1):
            if attempt:
                self.retries += 1
                self._sleep(self.spec.backoff_s * 2 ** (attempt - 1))
            self.requests += 1
            try:
                return self._post(body)
            except _Retryable as exc:
                last = str(exc)
        raise RemoteRewardError(
            f"reward service {self.spec.url} failed batch {index} ({len(body['ids'])} completions) "
            f"{self.spec.retries + 1} times; last error: {last}. Check the service, or raise "
            "rewards.remote.retries / rewards.remote.timeout_s")

    def _post(self, body: dict) -> list[float]:
        data = json.dumps(body).encode()
        request = urllib.request.Request(self.spec.url, data=data, method="POST",
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.spec.timeout_s) as response:
                raw = response.read()
        except urllib.error.HTTPError as exc:
            raise _Retryable(f"HTTP {exc.code}: {exc.read()[:200]!r}") from None
        except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as exc:
            raise _Retryable(f"{type(exc).__name__}: {exc}") from None
        try:
            answer = json.loads(raw)
            values = answer["scores"]
        except (ValueError, KeyError, TypeError):
            raise _Retryable(f"answer is not JSON with 'scores': {raw[:200]!r}") from None
        if "ids" in answer and answer["ids"] != body["ids"]:
            raise _Retryable("answer's ids do not match the request's")
        if not isinstance(values, list) or len(values) != len(body["ids"]):
            raise _Retryable(f"answer has {len(values) if isinstance(values, list) else 'no'} scores for "
                             f"{len(body['ids'])} completions")
        try:
            floats = [float(v) for v in values]
        except (TypeError, ValueError):
            raise _Retryable(f"non-numeric score in {values[:8]!r}") from None
        if not all(math.isfinite(v) for v in floats):
            raise _Retryable(f"non-finite score in {values[:8]!r}")
        return floats


class _Retryable(Exception):
    """One failed attempt (transport error, bad status, malformed answer)."""
