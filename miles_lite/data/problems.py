"""The problems a run works on, from the configuration: GSM8K files, seeded synthetic problems, or records
through a key mapping; the named evaluation sets; the identity of the training data."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from miles_lite.config.schema import DataConfig, EvalSetConfig, SyntheticDataConfig
from miles_lite.data.arithmetic import ArithmeticSpec, generate_problems
from miles_lite.data.gsm8k import DatasetError, MathProblem, load_gsm8k
from miles_lite.data.records import RecordKeys, load_records

# The evaluation set a records run gets from `data.eval_path` (greedy, one sample a prompt).
HELD_OUT_SET = "held_out"
# GSM8K problems held out of the training file when no `data.eval_path` is given (`experiment.eval_size` null).
DEFAULT_HOLD_OUT = 64


def synthetic_spec(syn: SyntheticDataConfig, seed: int) -> ArithmeticSpec:
    """The generator spec of `data.synthetic` with its seed replaced by `seed`; ValueError naming the field
    for bounds the generator refuses (steps, operands, max_result, ops)."""
    try:
        return ArithmeticSpec(min_steps=syn.min_steps, max_steps=syn.max_steps, min_operand=syn.min_operand,
                              max_operand=syn.max_operand, ops=tuple(syn.ops), max_result=syn.max_result, seed=seed)
    except ValueError as exc:
        raise ValueError(f"data.synthetic: {exc}") from None


def load_problems(data: DataConfig, eval_size: int | None,
                  notes: list[str] | None = None) -> tuple[list[MathProblem], list[MathProblem]]:
    """Training and held-out problems: GSM8K files, or seeded synthetic ones (disjoint seeds).

    `eval_size` (`experiment.eval_size`): 0 means no held-out problems (no evaluation) for either source.
    GSM8K: every problem of `data.eval_path` (None), or its first `eval_size` (a line saying so goes to
    `notes`); without an eval file the last `eval_size` (None: `DEFAULT_HOLD_OUT`) training problems are held
    out, and left out of training. Synthetic data holds out `data.synthetic.eval_size` problems.
    """
    if data.source == "records":  # held-out records are an evaluation set (`eval_set_configs`)
        return load_records(data.train_path, RecordKeys.from_config(data)), []
    if data.source == "gsm8k":
        train = load_gsm8k(str(data.train_path))
        if eval_size == 0:
            return train, []
        if data.eval_path:
            held_out = load_gsm8k(str(data.eval_path))
            if eval_size is not None and eval_size < len(held_out) and notes is not None:
                notes.append(f"held-out evaluation: the first {eval_size} of the {len(held_out)} problems of "
                             f"{data.eval_path} (experiment.eval_size={eval_size}; null evaluates every one)")
            return train, held_out[:eval_size] if eval_size is not None else held_out
        size = eval_size if eval_size is not None else DEFAULT_HOLD_OUT
        if size >= len(train):
            raise DatasetError(f"data.train_path={data.train_path} holds {len(train)} problems, too few to hold out "
                               f"{size} for evaluation (experiment.eval_size); give data.eval_path, or set "
                               "experiment.eval_size lower (0: no evaluation)")
        return train[:-size], train[-size:]
    syn = data.synthetic
    train = generate_problems(syn.train_size, synthetic_spec(syn, syn.seed))
    if eval_size == 0:
        return train, []
    seen = {p.question for p in train}
    held_out = [p for p in generate_problems(syn.eval_size * 3, synthetic_spec(syn, syn.seed + 7919))
                if p.question not in seen]
    return train, held_out[: syn.eval_size]


def read_problems(data: str, n: int | None, synthetic: SyntheticDataConfig) -> list[MathProblem]:
    """The questions of a command-line tool: a GSM8K-format file, or `n` synthetic problems of `data.synthetic`."""
    if n is not None and n < 1:
        raise ValueError(f"--n must be >= 1, got {n}")
    if data == "synthetic":
        syn = synthetic
        return generate_problems(n if n is not None else syn.train_size, synthetic_spec(syn, syn.seed))
    problems = load_gsm8k(data)
    return problems[:n] if n is not None else problems


def load_data_file(data: DataConfig, path: Any, field: str = "data.eval_path") -> list[Any]:
    """A file in the run's data format: records through `data.*_key` (any records path: a file, a folder, a
    glob, a list), else GSM8K question/answer records."""
    if data.source == "records":
        return load_records(path, RecordKeys.from_config(data), field)
    return load_gsm8k(path)


@dataclass(frozen=True)
class EvalSet:
    """A named evaluation set: its settings and its prompts (records or math problems). `total`: the prompts
    in its file (more than `items` when `size` cut it; 0: not known)."""

    name: str
    cfg: EvalSetConfig
    items: list[Any]
    total: int = 0

    @property
    def cut(self) -> str | None:
        """What the set's `size` left out, as a report says it; None when it evaluates its whole file."""
        if self.total <= len(self.items):
            return None
        return f"the first {len(self.items)} of the {self.total} records of {self.cfg.path}"


def eval_set_configs(data: DataConfig, eval_size: int | None) -> dict[str, EvalSetConfig]:
    """`data.eval_sets`, plus `held_out` from `data.eval_path` for records (greedy, k=1; every record, or the
    first `eval_size` (`experiment.eval_size`)) unless it is 0 or a set of that name is configured."""
    sets = dict(data.eval_sets)
    if data.source == "records" and data.eval_path and eval_size != 0 and HELD_OUT_SET not in sets:
        sets[HELD_OUT_SET] = EvalSetConfig(path=data.eval_path, size=eval_size or 0)
    return sets


def load_eval_sets(data: DataConfig, eval_size: int | None) -> list[EvalSet]:
    """Every evaluation set, read now so that a bad file stops the run before it has a directory."""
    sets = []
    for name, set_cfg in eval_set_configs(data, eval_size).items():
        if not set_cfg.path:
            raise DatasetError(f"data.eval_sets.{name}.path is not set; give the set's jsonl/parquet file")
        field = f"data.eval_sets.{name}.path" if name in data.eval_sets else "data.eval_path"
        items = load_data_file(data, set_cfg.path, field)
        sets.append(EvalSet(name, set_cfg, items[: set_cfg.size] if set_cfg.size else items, len(items)))
    return sets
