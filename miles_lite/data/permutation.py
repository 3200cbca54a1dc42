"""A learnable token task for trainer checks: every token is a fixed permutation of the previous one.

A model learns it within tens of SFT steps, so loss curves of two precisions (bf16 vs FP8) can be
compared on it; the GPU tests and `benchmarks/train_step.py` use the same stream.
"""

from __future__ import annotations

import random

from miles_lite.types import TrainBatch

FIRST_ID = 10  # ids below are left to control tokens


def permutation_batch(vocab: int, n: int, length: int, step: int, symbols: int = 64) -> TrainBatch:
    """Batch `step` of a deterministic stream: `n` sequences of `length` ids, the first 4 as prompt.

    After a random first symbol, each symbol is `perm[previous]` for one fixed permutation of `symbols`
    ids (offset by 10). Rollout log-probs and advantages are zero (SFT use).

    Raises:
        ValueError: `vocab` has fewer than `10 + symbols` ids.
    """
    if vocab < FIRST_ID + symbols:
        raise ValueError(f"vocab_size={vocab} is too small for the permutation task ({FIRST_ID + symbols} ids)")
    perm = list(range(symbols))
    random.Random(0).shuffle(perm)
    rng = random.Random(1000 + step)
    tokens = []
    for _ in range(n):
        seq = [rng.randrange(symbols)]
        while len(seq) < length:
            seq.append(perm[seq[-1]])
        tokens.append([FIRST_ID + t for t in seq])
    return TrainBatch(tokens=tokens, prompt_lengths=[4] * n, rollout_logprobs=[[0.0] * (length - 4)] * n,
                      advantages=[0.0] * n)
