"""The embedded default's trainer steps on the local (CPU) spec: padded micro-batches against the packed row.

    python benchmarks/cpu_micro_batches.py                        # 20 interleaved rounds, budget 512
    python benchmarks/cpu_micro_batches.py --steps 30 --budgets 512 1024 2048

Builds what `miles-lite train` (`experiment=tiny_cpu`) trains: its initial model, its SFT batch (the
prompts and tag-format reference solutions of 16 training problems) and an RL batch of the size the
default trains after leaving out zero-signal groups (40 sequences: prompt + reference solution of 40
other problems, random rollout log-probs, GRPO advantages of random rewards in groups of 8). Then times
`sft_step` and `train_step` of one `TrainerActor` in each layout, interleaved (A, B, A, B, ...) so that
the load of a shared machine falls on every variant alike:

- `packed_row`: the previous layout, one packed row per micro-batch under a `[T, T]` block-diagonal
  mask, `trainer.micro_batch_tokens` counting real tokens;
- `padded`: the trainer's layout, a right-padded `[B, S]` batch under a causal mask, the budget
  counting padding.

Prints min / median / max seconds per step of each variant and the median ratio, with the load average
before and after.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from step_timing import time_interleaved  # this directory: benchmarks run as scripts

from miles_lite.config.compose import load_config
from miles_lite.config.views import ActorConfig
from miles_lite.data.encoding import PromptEncoder
from miles_lite.data.problems import load_problems
from miles_lite.net.ports import LOCAL_HOST, free_port
from miles_lite.run.model_assets import prepare_model
from miles_lite.trainer.actor import TrainerActor
from miles_lite.trainer.reference_layout import packed_row_layout
from miles_lite.types import TrainBatch


def rl_batch(sft: TrainBatch, seed: int, group: int = 8) -> TrainBatch:
    """`sft`'s sequences with random rollout log-probs and GRPO advantages of random 0/1 rewards."""
    rng = random.Random(seed)
    lps = [[-2.0 * rng.random() for _ in range(n)] for n in sft.response_lengths]
    adv: list[float] = []
    for g in range(0, sft.num_sequences, group):
        rewards = [float(rng.random() < 0.5) for _ in range(min(group, sft.num_sequences - g))]
        mean = sum(rewards) / len(rewards)
        std = (sum((r - mean) ** 2 for r in rewards) / len(rewards)) ** 0.5
        adv.extend((r - mean) / (std + 1e-6) for r in rewards)
    return TrainBatch(tokens=sft.tokens, prompt_lengths=sft.prompt_lengths, rollout_logprobs=lps, advantages=adv)


def variants(actor: TrainerActor, step: Callable[[], Any], budgets: list[int]) -> dict[str, Callable[[], Any]]:
    """`packed_row@B0` (the first budget) and `padded@B` for every budget, each setting its budget before the step."""
    trainer = actor.cfg.trainer

    def packed() -> None:
        trainer.micro_batch_tokens = budgets[0]
        with packed_row_layout():
            step()

    def padded(budget: int) -> Callable[[], None]:
        def run() -> None:
            trainer.micro_batch_tokens = budget
            step()
        return run

    return {f"packed_row@{budgets[0]}": packed, **{f"padded@{b}": padded(b) for b in budgets}}


def report(title: str, times: dict[str, list[float]], micro_batches: dict[str, int]) -> None:
    print(f"{title}: seconds per step, {len(next(iter(times.values())))} interleaved rounds")
    base = statistics.median(next(iter(times.values())))
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"  {name:<18} micro-batches {micro_batches[name]:>2}   min {min(ts):.3f}  median {med:.3f}  "
              f"max {max(ts):.3f}   median vs first {med / base:.2f}x", flush=True)


def count_micro_batches(actor: TrainerActor, batch: TrainBatch, budgets: list[int]) -> dict[str, int]:
    trainer = actor.cfg.trainer
    out = {}
    trainer.micro_batch_tokens = budgets[0]
    with packed_row_layout():
        out[f"packed_row@{budgets[0]}"] = len(actor._micro_batches(batch))
    for b in budgets:
        trainer.micro_batch_tokens = b
        out[f"padded@{b}"] = len(actor._micro_batches(batch))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20, help="timed rounds (each runs every variant once)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    ap.add_argument("--budgets", type=int, nargs="+", default=[512],
                    help="trainer.micro_batch_tokens values (the packed row uses the first)")
    ap.add_argument("--rl-sequences", type=int, default=40)
    args = ap.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="cpu_micro_batches_") as tmp:
        cfg = load_config([f"experiment.output_dir={tmp}"])
        cfg, tokenizer = prepare_model(cfg, Path(tmp))
        problems, _ = load_problems(cfg.data, cfg.experiment.eval_size)
        encoder = PromptEncoder(tokenizer, cfg.data.prompt_template)
        bs = cfg.experiment.warmup_batch_size
        sft = encoder.sft_batch(problems[:bs])
        rl = rl_batch(encoder.sft_batch(problems[bs:bs + args.rl_sequences]), seed=0)
        lengths = [len(t) for t in rl.tokens]
        print(f"SFT batch: {sft.num_sequences} sequences, {sft.num_tokens} tokens; RL batch: {rl.num_sequences} "
              f"sequences, {rl.num_tokens} tokens ({min(lengths)}-{max(lengths)} per sequence)")
        print(f"load average before: {os.getloadavg()[0]:.2f}", flush=True)
        actor = TrainerActor(ActorConfig.of(cfg), 0, 1, init_method=f"tcp://{LOCAL_HOST}:{free_port(LOCAL_HOST)}")
        try:
            lr = cfg.experiment.warmup_lr
            sft_times = time_interleaved(variants(actor, lambda: actor.sft_step(sft, lr=lr), args.budgets),
                                    args.warmup, args.steps)
            report("SFT step", sft_times, count_micro_batches(actor, sft, args.budgets))
            rl_times = time_interleaved(variants(actor, lambda: actor.train_step(rl), args.budgets),
                                        args.warmup, args.steps)
            report("RL train step", rl_times, count_micro_batches(actor, rl, args.budgets))
        finally:
            actor.close()
        print(f"load average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
