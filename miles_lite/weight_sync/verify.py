"""Checks that a push really changed what every engine serves.

A fixed batch of token sequences (the probe) is scored by each engine (`engine.score`) and by the trainer
(`trainer_logprobs`, an FP8 trainer in its weights' own bf16, so quantisation noise does not count as a weight
difference); the per-token |logp diff| mean and max are reported and the mean is guarded by
`weight_sync.max_probe_logp_diff` (unset: a bound chosen for the run's precision, engines and architecture,
`config.weight_sync_choice.probe_bound`). The engine's pre-push scores are kept: if the post-push scores still
equal them while the trainer's own scores moved, the engine acknowledged the push but kept its old weights (an
OOM swallowed with a 200, a dropped update) and is named as such. Every layout, transport and adapter push is
checked this way: the probe reads what the engine computes with, whatever shape its parameters take.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from miles_lite.weight_sync.transport import EngineLoop, FleetEngine, WeightSyncError

# Trainer logprobs of the probe: sequences -> per sequence, logprobs of tokens [prompt_len:] (nats).
TrainerScorer = Callable[["ProbeBatch"], list[list[float]]]


@dataclass(frozen=True)
class ProbeBatch:
    """Fixed token sequences; tokens from `prompt_lens[i]` on are scored."""

    sequences: tuple[tuple[int, ...], ...]
    prompt_lens: tuple[int, ...]


def make_probe(vocab_size: int, sequences: int, tokens: int, seed: int = 0) -> ProbeBatch:
    """`sequences` random sequences of `tokens` ids in [0, vocab_size), each scored after its first token."""
    if vocab_size < 2 or sequences < 1 or tokens < 2:
        raise ValueError(f"probe needs vocab_size>=2, weight_sync.probe_sequences>=1, weight_sync.probe_tokens>=2; "
                         f"got {vocab_size}, {sequences}, {tokens}")
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (sequences, tokens), generator=g)
    return ProbeBatch(tuple(tuple(int(t) for t in row) for row in ids), (1,) * sequences)


@dataclass
class EngineCheck:
    """Per-engine results of one verification."""

    logp_diff_mean: float = 0.0
    logp_diff_max: float = 0.0


@dataclass
class VerifyReport:
    version: str
    engines: dict[str, EngineCheck] = field(default_factory=dict)
    # The bound the mean was held to (`weight_sync.max_probe_logp_diff`, or the one chosen for the run).
    bound: float = 0.0

    @property
    def logp_diff_mean(self) -> float:
        return max((c.logp_diff_mean for c in self.engines.values()), default=0.0)

    @property
    def logp_diff_max(self) -> float:
        return max((c.logp_diff_max for c in self.engines.values()), default=0.0)


def _flat(values: Sequence[Sequence[float]]) -> torch.Tensor:
    return torch.tensor([v for row in values for v in row], dtype=torch.float64)


class PushVerifier:
    """Probe verification around pushes (see the module docstring). `bound_note` says where the bound came from
    when the run chose it (named in a failed verification's message)."""

    def __init__(self, loop: EngineLoop, probe: ProbeBatch, trainer_logprobs: TrainerScorer, *,
                 max_probe_logp_diff: float, bound_note: str = "") -> None:
        if max_probe_logp_diff <= 0:
            raise ValueError(f"weight_sync.max_probe_logp_diff={max_probe_logp_diff} must be > 0")
        self.loop = loop
        self.probe = probe
        self.trainer_logprobs = trainer_logprobs
        self.max_diff = max_probe_logp_diff
        self.bound_note = bound_note
        self._before: dict[str, torch.Tensor] = {}
        self._before_version: str | None = None
        # The trainer's probe scores at the last verified push: a dropped update is named only when the
        # trainer's own scores moved since then (an optimizer step that changes nothing is not a drop).
        self._trainer_last: torch.Tensor | None = None
        # Per engine: (serving key, probe scores) at the last push it passed.
        self._verified: dict[str, tuple[tuple[str, str, int], torch.Tensor]] = {}
        # (version, the trainer's probe scores) taken ahead of that version's verification (`score_trainer`).
        self._trainer_ahead: tuple[str, torch.Tensor] | None = None

    def _submit_scores(self, fleet: Sequence[FleetEngine]) -> dict[str, Future[torch.Tensor]]:
        async def score(engine: FleetEngine) -> torch.Tensor:
            # One request per sequence, all in flight at once: the engine batches them.
            rows = await asyncio.gather(*(engine.engine.score(list(seq), plen) for seq, plen
                                          in zip(self.probe.sequences, self.probe.prompt_lens, strict=True)))
            return _flat(rows)

        return {f.engine_id: self.loop.submit(score(f)) for f in fleet}

    @staticmethod
    def _serving_key(f: FleetEngine) -> tuple[str, str, int]:
        # A replaced engine (new process, new client) never matches its predecessor's key.
        return f.engine_id, f.engine.url, id(f.engine)

    def before_push(self, fleet: Sequence[FleetEngine], version: str) -> None:
        """Record each engine's probe scores under the weights it serves now.

        An engine that passed the last verification still serves those weights (only pushes change
        them), so its scores from then are reused instead of asking it again. A repeated push of the
        same `version` (made again without an engine that died during the first) keeps the scores taken
        before the first attempt: some engines may hold the new weights.
        """
        if version != self._before_version:
            self._before, self._before_version = {}, version
        missing = [f for f in fleet if f.engine_id not in self._before]
        to_score = []
        for f in missing:
            key, scores = self._verified.get(f.engine_id, (None, None))
            if key == self._serving_key(f) and scores is not None:
                self._before[f.engine_id] = scores
            elif not getattr(f.engine, "released", None):
                # An engine asleep (memory released) cannot score: without earlier scores only the comparison
                # with the trainer after the push applies to it.
                to_score.append(f)
        if to_score:
            self._before.update(self.loop.gather(self._submit_scores(to_score)))

    def score_trainer(self, version: str) -> None:
        """Score the probe on the trainer now, for the verification of `version`, which then waits for the
        engines' scores only. The trainer must hold the weights `version` carries: a hand-off takes them before
        its push, ahead of its offload's copies (`run/handoff.py`)."""
        self._trainer_ahead = (str(version), _flat(self.trainer_logprobs(self.probe)))

    def _trainer_scores(self, version: str) -> torch.Tensor:
        """The trainer's probe scores for `version`: those taken ahead for it (once), else taken now."""
        ahead, self._trainer_ahead = self._trainer_ahead, None
        if ahead is not None and ahead[0] == str(version):
            return ahead[1]
        return _flat(self.trainer_logprobs(self.probe))

    def verify(self, fleet: Sequence[FleetEngine], version: str) -> VerifyReport:
        """Raise `WeightSyncError` naming every engine that does not serve the new weights."""
        report = VerifyReport(str(version), bound=self.max_diff)
        pending = self._submit_scores(fleet)  # the engines score while the trainer does (unless it did ahead)
        want = self._trainer_scores(version)
        got = self.loop.gather(pending)
        problems: list[str] = []
        for f in fleet:
            eid = f.engine_id
            scores = got[eid]
            if scores.shape != want.shape:
                problems.append(f"engine {eid}: probe returned {scores.numel()} logprobs, trainer {want.numel()}")
                continue
            diff = (scores - want).abs()
            check = EngineCheck(float(diff.mean()), float(diff.max()))
            report.engines[eid] = check
            before = self._before.get(eid)
            moved = (self._trainer_last is not None and self._trainer_last.shape == want.shape
                     and float((self._trainer_last - want).abs().mean()) > self.max_diff)
            unchanged = before is not None and torch.equal(scores, before)
            # Unchanged scores are a drop when the trainer's moved since the last verified push, or when they do
            # not match the trainer's now (the first push of a run, or after an engine joined).
            if unchanged and (moved or not check.logp_diff_mean <= self.max_diff):
                problems.append(f"engine {eid}: acknowledged version {version} but its probe logprobs are unchanged "
                                f"(it kept the old weights)")
            elif not check.logp_diff_mean <= self.max_diff:  # NaN (weights with NaNs) fails too
                problems.append(f"engine {eid}: probe |logp diff| mean {check.logp_diff_mean:.3g} > "
                                f"weight_sync.max_probe_logp_diff={self.max_diff:g}{self.bound_note}")
        if problems:
            raise WeightSyncError("weight push verification failed: " + "; ".join(problems))
        self._trainer_last = want
        # Engines left out of this push (e.g. a push to stale engines only) keep their last scores.
        self._verified.update({f.engine_id: (self._serving_key(f), got[f.engine_id]) for f in fleet})
        return report
