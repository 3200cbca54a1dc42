"""What changed between the configuration a checkpoint was trained with and the one a resume asks for,
and what each change means for that checkpoint.

Kinds of change, by field:

- `refused`: the checkpoint's weights cannot take it: the model's architecture, shape, vocabulary and
  tokenizer (`model.*`).
- `data`: the training data's source and identity (`data.source`, `data.train_path`, `data.synthetic.*`
  but its `eval_size`, and the key mapping of records: `data.prompt_key` and the other `data.*_key`). These
  are judged by the data's identity (`miles_lite.data.identity`), not field
  by field: a file moved with the same content is the same data.
- `spent`: settings of what ran once, before the first RL step (the warm-up, the presample filter) or
  that the checkpoint carries over (`data.shuffle_seed`: the saved prompt order continues). They take
  effect only in a new run.
- `ignored`: where the run lives and how it resumes (`experiment.output_dir`, `experiment.run_name`,
  `checkpoint.resume`, `checkpoint.allow_data_change`): not changes of the training.
- `applied`: everything else: steps, learning rate and schedule, optimizer, TP/DP (checkpoints reshard),
  algorithm, rewards, rollout and engine settings, weight sync, evaluation, logging. The checkpoint
  holds no rollout groups (batches in flight go back to the prompt stream), so group size and advantage
  estimator changes apply too.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from omegaconf import OmegaConf

from miles_lite.config.schema import MilesConfig

REFUSED_FIELDS = ("model.",)
DATA_FIELDS = ("data.source", "data.train_path", "data.synthetic.", "data.prompt_key", "data.messages_key",
               "data.label_key", "data.metadata_key", "data.source_key", "data.response_key")
DATA_EXCEPTIONS = ("data.synthetic.eval_size",)
SPENT_FIELDS = ("experiment.warmup*", "data.presample.", "data.shuffle_seed")
IGNORED_FIELDS = ("experiment.output_dir", "experiment.run_name", "checkpoint.resume", "checkpoint.allow_data_change")

KINDS = ("refused", "data", "spent", "ignored", "applied")


class _Unset:
    def __repr__(self) -> str:
        return "unset"


UNSET: Any = _Unset()


def config_tree(cfg: MilesConfig) -> dict[str, Any]:
    """The resolved configuration as plain JSON-able data (what a checkpoint records)."""
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)  # type: ignore[return-value]


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Dotted field name -> value; mappings (config groups and pass-through dicts) are opened, lists are values."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


def _matches(field: str, patterns: tuple[str, ...]) -> bool:
    """`patterns`: exact names, group prefixes ending in "." and name prefixes ending in "*"."""
    return any(field.startswith(p.rstrip("*")) if p.endswith((".", "*")) else field == p for p in patterns)


def change_kind(field: str) -> str:
    """One of `KINDS` for a dotted field name (see the module docstring)."""
    if field in IGNORED_FIELDS:
        return "ignored"
    if _matches(field, REFUSED_FIELDS):
        return "refused"
    if _matches(field, DATA_FIELDS) and field not in DATA_EXCEPTIONS:
        return "data"
    if _matches(field, SPENT_FIELDS):
        return "spent"
    return "applied"


def show(value: Any) -> str:
    """A value as a message shows it: YAML-like scalars, `unset` for a field one side lacks."""
    if value is UNSET:
        return "unset"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return repr(value) if not value or value.strip() != value or " " in value else value
    return str(value)


@dataclass(frozen=True)
class Change:
    """One field whose value differs: `old` (recorded) -> `new` (asked for now)."""

    field: str
    old: Any
    new: Any

    @property
    def kind(self) -> str:
        return change_kind(self.field)

    def describe(self) -> str:
        return f"{self.field} {show(self.old)} -> {show(self.new)}"

    def as_json(self) -> dict[str, Any]:
        return {"field": self.field, "from": None if self.old is UNSET else self.old,
                "to": None if self.new is UNSET else self.new}


def config_changes(recorded: Mapping[str, Any], current: Mapping[str, Any]) -> list[Change]:
    """Every field whose value differs between two `config_tree`s, in field order."""
    old, new = flatten(recorded), flatten(current)
    changes = []
    for field in sorted(set(old) | set(new)):
        a, b = old.get(field, UNSET), new.get(field, UNSET)
        if a != b and not (isinstance(a, int | float) and isinstance(b, int | float) and float(a) == float(b)):
            changes.append(Change(field, a, b))
    return changes
