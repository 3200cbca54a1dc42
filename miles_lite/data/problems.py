"""The problems a run works on, from the configuration: GSM8K files or seeded synthetic problems."""

from __future__ import annotations

from miles_lite.config.schema import MilesConfig, SyntheticDataConfig
from miles_lite.data.arithmetic import ArithmeticSpec, generate_problems
from miles_lite.data.gsm8k import MathProblem, load_gsm8k


def synthetic_spec(syn: SyntheticDataConfig, seed: int) -> ArithmeticSpec:
    """The generator spec of `data.synthetic` with its seed replaced by `seed`; ValueError naming the field
    for bounds the generator refuses (steps, operands, max_result, ops)."""
    try:
        return ArithmeticSpec(min_steps=syn.min_steps, max_steps=syn.max_steps, min_operand=syn.min_operand,
                              max_operand=syn.max_operand, ops=tuple(syn.ops), max_result=syn.max_result, seed=seed)
    except ValueError as exc:
        raise ValueError(f"data.synthetic: {exc}") from None


def load_problems(cfg: MilesConfig) -> tuple[list[MathProblem], list[MathProblem]]:
    """Training and held-out problems: GSM8K files, or seeded synthetic ones (disjoint seeds).

    `experiment.eval_size=0` means no held-out problems (no evaluation) for either source; otherwise
    it caps a GSM8K held-out set, and synthetic data holds out `data.synthetic.eval_size` problems.
    """
    size = cfg.experiment.eval_size
    if cfg.data.source == "gsm8k":
        train = load_gsm8k(str(cfg.data.train_path))
        if not size:
            return train, []
        held_out = load_gsm8k(str(cfg.data.eval_path)) if cfg.data.eval_path else train[-size:]
        return train, held_out[:size]
    syn = cfg.data.synthetic
    train = generate_problems(syn.train_size, synthetic_spec(syn, syn.seed))
    if not size:
        return train, []
    seen = {p.question for p in train}
    held_out = [p for p in generate_problems(syn.eval_size * 3, synthetic_spec(syn, syn.seed + 7919))
                if p.question not in seen]
    return train, held_out[: syn.eval_size]


def read_problems(data: str, n: int | None, cfg: MilesConfig) -> list[MathProblem]:
    """The questions of a command-line tool: a GSM8K-format file, or `n` synthetic problems of `data.synthetic`."""
    if n is not None and n < 1:
        raise ValueError(f"--n must be >= 1, got {n}")
    if data == "synthetic":
        syn = cfg.data.synthetic
        return generate_problems(n if n is not None else syn.train_size, synthetic_spec(syn, syn.seed))
    problems = load_gsm8k(data)
    return problems[:n] if n is not None else problems
