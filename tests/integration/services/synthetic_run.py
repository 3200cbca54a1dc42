"""A short synthetic run that produces the driver's per-step stats dicts with the real project code.

Completions are written by a seeded "policy" whose accuracy improves over the steps (no model),
then scored by `miles_lite.rewards.score_completions`, turned into advantages by
`miles_lite.algo.compute_advantages`, compared against perturbed trainer log-probs by
`miles_lite.algo.mismatch_metrics`, and trained on through `miles_lite.algo.total_loss` with a real
backward pass. Sync and checkpoint phases time real tensor copies and a real `torch.save`.
"""

from __future__ import annotations

import math
import random
import statistics
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from miles_lite.algo import LossConfig, compute_advantages, kl_penalty, mismatch_metrics, total_loss
from miles_lite.data.arithmetic import ArithmeticSpec, generate_problems
from miles_lite.formats.answer import SOLUTION_END, SOLUTION_START, WORK_END, WORK_START
from miles_lite.rewards import score_completions
from miles_lite.types import Group, Sample


@dataclass
class SyntheticStep:
    """One step: the stats dict the driver would publish, its scored groups, and sync/checkpoint sizes."""

    step: int
    stats: dict[str, object]
    groups: list[Group]
    sync_bytes: int
    checkpoint_bytes: int


def _completion(rng: random.Random, answer: float, steps: tuple[float, ...], skill: float) -> str:
    """A completion that is right and well formatted with probability ~`skill`."""
    work = " ".join(f"{s:g}" for s in steps[:-1]) or "thinking"
    value = answer if rng.random() < skill else answer + rng.choice([-3, -1, 1, 2, 10])
    roll = rng.random()
    if roll < skill:
        return f"{WORK_START} {work} {WORK_END}{SOLUTION_START}{value:g}{SOLUTION_END}"
    if roll < 0.5 + skill / 2:
        return f"{WORK_START} {work} {WORK_END} the answer is {value:g}"
    return f"I think it is {value:g}."


def _padded(rows: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    values = torch.zeros(len(rows), width)
    mask = torch.zeros(len(rows), width)
    for i, r in enumerate(rows):
        values[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1.0
    return values, mask


def synthetic_steps(num_steps: int, prompts: int = 4, group_size: int = 4, seed: int = 0,
                    workdir: Path | None = None) -> Iterator[SyntheticStep]:
    """Yield `num_steps` steps (numbered from 1) of stats in the `metrics.publish_step` vocabulary."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    # The "policy": a per-token log-prob offset the loss trains, so grad norms are real.
    policy = torch.zeros(64, requires_grad=True)
    loss_cfg = LossConfig(kl_coef=0.01, entropy_coef=0.001)
    tmp = tempfile.TemporaryDirectory() if workdir is None else None
    ckpt_dir = Path(tmp.name) if tmp is not None else workdir
    try:
        for step in range(1, num_steps + 1):
            times: dict[str, float] = {}
            t0 = time.perf_counter()
            problems = generate_problems(prompts, ArithmeticSpec(seed=seed * 1000 + step, max_steps=2))
            skill = min(0.9, 0.2 + 0.1 * step)
            groups, latencies = [], []
            for index, problem in enumerate(problems):
                t_req = time.perf_counter()
                group = Group(prompt_index=index, prompt_text=problem.question, question=problem.question,
                              answer=problem.answer, steps=problem.steps)
                for _ in range(group_size):
                    text = _completion(rng, problem.answer, problem.steps, skill)
                    length = len(text.split()) + 4
                    logprobs = [-abs(rng.gauss(0.6, 0.4)) for _ in range(length)]
                    group.samples.append(Sample(
                        prompt_index=index, prompt_ids=list(range(12)), response_ids=list(range(length)),
                        rollout_logprobs=logprobs, response_text=text, finish_reason="stop",
                        engine_id=f"engine-{index % 2}", weight_version=str(step - 1)))
                groups.append(group)
                latencies.append(time.perf_counter() - t_req)
            times["generate"] = time.perf_counter() - t0

            t0 = time.perf_counter()
            samples = [s for g in groups for s in g.samples]
            scores = score_completions([s.response_text for s in samples],
                                       [g.answer for g in groups for _ in g.samples],
                                       [g.question for g in groups for _ in g.samples],
                                       [g.steps for g in groups for _ in g.samples])
            for sample, score in zip(samples, scores, strict=True):
                sample.rewards = dict(score)
            totals = [s.reward for s in samples]
            adv = compute_advantages(torch.tensor(totals), group_size, "grpo")
            times["reward"] = time.perf_counter() - t0

            t0 = time.perf_counter()
            rollout_logp, mask = _padded([s.rollout_logprobs for s in samples])
            drift = 0.002 * step
            train_logp = rollout_logp + drift * torch.randn_like(rollout_logp) * mask
            mm = mismatch_metrics(train_logp, rollout_logp, mask, level="token", mode="mask", upper=1.01)
            times["logprobs"] = time.perf_counter() - t0

            t0 = time.perf_counter()
            width = mask.shape[1]
            logp = train_logp + policy[:width].unsqueeze(0) * mask
            ref_logp = rollout_logp
            entropy = (0.9 - 0.02 * step + 0.05 * torch.rand_like(mask)) * mask + 0 * logp
            advantages = adv.advantages.unsqueeze(1) * mask
            loss, loss_stats = total_loss(logp, rollout_logp, advantages, mask, loss_cfg, ref_logp=ref_logp,
                                          entropy=entropy)
            loss.backward()
            assert policy.grad is not None
            grad_norm = float(policy.grad.norm())
            # Plain SGD with norm clipping at 1 (torch.optim would import torch._dynamo: ~10 s on 2 cores).
            with torch.no_grad():
                policy -= 0.05 * policy.grad / max(1.0, grad_norm)
            policy.grad = None
            kl = float((kl_penalty(logp.detach(), ref_logp, "k3", mask=mask) * mask).sum() / mask.sum())
            times["train"] = time.perf_counter() - t0

            t0 = time.perf_counter()
            pushed = policy.detach().clone()
            sync_bytes = pushed.numel() * pushed.element_size()
            times["sync"] = time.perf_counter() - t0

            t0 = time.perf_counter()
            path = ckpt_dir / f"step_{step}.pt"
            torch.save({"policy": policy.detach(), "step": step}, path)
            ckpt_bytes = path.stat().st_size
            times["checkpoint"] = time.perf_counter() - t0

            tokens = sum(len(s.response_ids) for s in samples)
            stats: dict[str, object] = {
                "rollout/tokens_per_second": tokens / max(times["generate"], 1e-9),
                "rollout/generated_tokens": tokens,
                "rollout/request_latency_seconds": latencies,
                "rollout/retried_requests": 1 if step == 2 else 0,
                "rollout/dynamic_sampling_rounds": 1,
                "reward/mean": statistics.fmean(totals),
                "reward/std": statistics.pstdev(totals),
                "reward/exact_accuracy": statistics.fmean(s.rewards["exact_check"] for s in samples),
                "algo/zero_signal_share": adv.zero_signal_share,
                "kl/ref_k3": kl,
                "entropy": float((entropy.detach() * mask).sum() / mask.sum()),
                "grad_norm": grad_norm,
                "skipped": 0.0,
                "weight_version": step,
                **{k: v for k, v in loss_stats.items() if math.isfinite(v)},
                **mm,
                **{f"time/{phase}_seconds": seconds for phase, seconds in times.items()},
            }
            for name in samples[0].rewards:
                stats[f"reward/values/{name}"] = [s.rewards[name] for s in samples]
            yield SyntheticStep(step, stats, groups, sync_bytes, ckpt_bytes)
    finally:
        if tmp is not None:
            tmp.cleanup()
