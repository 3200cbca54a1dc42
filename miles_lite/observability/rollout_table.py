"""The rollout table: every completion of every step, as parquet under ``<run_dir>/rollouts/``.

One file per step (``step_000012.parquet``), written to a temporary name and renamed, so a reader
never sees half a file and a crash loses at most the step being written. All files share
:data:`SCHEMA`; ``read_rollouts(run_dir)`` (or ``pyarrow.dataset.dataset(run_dir / "rollouts")``)
reads them as one table. Rewards are a ``map<string, double>`` column so that runs with different
reward sets still share one schema.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import pyarrow as pa
import pyarrow.parquet as pq

from miles_lite.formats.files import temporary_name
from miles_lite.types import Group

ROLLOUT_DIR = "rollouts"

SCHEMA = pa.schema([
    pa.field("step", pa.int64(), nullable=False),
    pa.field("prompt_index", pa.int64()),
    pa.field("sample_index", pa.int64()),
    pa.field("prompt", pa.string()),
    pa.field("completion", pa.string()),
    pa.field("rewards", pa.map_(pa.string(), pa.float64())),
    pa.field("total", pa.float64()),
    pa.field("finish_reason", pa.string()),
    pa.field("length", pa.int64()),
    pa.field("mean_logprob", pa.float64()),
    pa.field("engine", pa.string()),
    pa.field("weight_version", pa.string()),
    # Model turns of a multi-turn trajectory (1 for single-turn); `completion` holds every turn and reply.
    pa.field("turns", pa.int64()),
    # The prompt's label (a string as it is, any other JSON value as JSON) and its data source (null: none).
    pa.field("label", pa.string()),
    pa.field("source", pa.string()),
    # What reward plug-ins logged for the completion with `log_extra(column, values)`: column -> the value (a
    # string as it is, any other value as JSON).
    pa.field("extra", pa.map_(pa.string(), pa.string())),
    # What the agent plug-in returned for the sample (`rollout.agent`), as JSON; null without an agent.
    pa.field("agent", pa.string()),
])


@dataclass(frozen=True)
class RolloutRow:
    """One completion (`sample_index`: its place in the group). `length` counts response tokens;
    `mean_logprob` is the engine's mean log-prob per token (nats), NaN for an empty response."""

    step: int
    prompt_index: int
    sample_index: int
    prompt: str
    completion: str
    total: float
    finish_reason: str
    length: int
    mean_logprob: float
    engine: str
    weight_version: str
    # Raw value of every reward function (the weighted sum is `total`).
    rewards: dict[str, float | None] = field(default_factory=dict)
    turns: int = 1
    label: str | None = None
    source: str | None = None
    extra: dict[str, str | None] = field(default_factory=dict)
    agent: str | None = None


def _text(value: object) -> str | None:
    """A value as the table's string columns show it: a string as it is, None as null, else JSON."""
    if value is None or isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False, default=str)


def label_text(group: Group) -> str | None:
    """The group's label as the table shows it: a string as it is, anything else as JSON."""
    label = getattr(group.record, "label", None) if group.record is not None else group.answer
    return _text(label)


def rows_from_groups(step: int, groups: Sequence[Group]) -> list[RolloutRow]:
    """Flatten scored groups into rows (one per sample), in group order."""
    rows = []
    for group in groups:
        for j, sample in enumerate(group.samples):
            lps = sample.rollout_logprobs
            rows.append(RolloutRow(
                step=step,
                prompt_index=group.prompt_index,
                sample_index=j,
                prompt=group.prompt_text,
                completion=sample.response_text,
                total=sample.reward,
                finish_reason=sample.finish_reason,
                length=len(sample.response_ids),
                mean_logprob=sum(lps) / len(lps) if lps else math.nan,
                engine=sample.engine_id,
                weight_version=sample.weight_version,
                # NaN: the reward does not apply to this sample (None in the table).
                rewards={k: None if math.isnan(v) else float(v) for k, v in sample.rewards.items() if k != "total"},
                turns=sample.turns,
                label=label_text(group),
                source=group.source,
                extra={column: _text(value) for column, value in sample.extra.items()},
                agent=None if sample.agent is None else json.dumps(sample.agent, ensure_ascii=False, default=str),
            ))
    return rows


class RowLike(Protocol):
    """Any record with the schema's fields as attributes (e.g. :class:`RolloutRow`)."""

    step: int
    rewards: dict[str, float]


def _to_table(rows: Sequence[RowLike]) -> pa.Table:
    columns: dict[str, list[object]] = {name: [] for name in SCHEMA.names}
    for row in rows:
        for name in SCHEMA.names:
            value = getattr(row, name, {}) if name == "extra" else getattr(row, name)
            columns[name].append(list(value.items()) if name in ("rewards", "extra") else value)
    return pa.table(columns, schema=SCHEMA)


class RolloutTableWriter:
    """Appends one parquet file per step under ``<run_dir>/rollouts/``."""

    def __init__(self, run_dir: str | os.PathLike[str]) -> None:
        self.dir = Path(run_dir) / ROLLOUT_DIR
        self.dir.mkdir(parents=True, exist_ok=True)

    def path_for(self, step: int) -> Path:
        return self.dir / f"step_{step:06d}.parquet"

    def write_step(self, step: int, rows: Sequence[RowLike]) -> Path | None:
        """Write the rows of `step` (replacing an earlier file of that step, e.g. after resume).

        Returns the file written, or None for no rows.

        Raises:
            ValueError: a row's `step` differs from `step`.
        """
        if not rows:
            return None
        wrong = {r.step for r in rows} - {step}
        if wrong:
            raise ValueError(f"rollout rows carry step(s) {sorted(wrong)} but are written as step {step}")
        path = self.path_for(step)
        tmp = temporary_name(path)
        try:
            pq.write_table(_to_table(rows), tmp, compression="zstd")
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return path

    def write_groups(self, step: int, groups: Sequence[Group]) -> Path | None:
        """`write_step` of :func:`rows_from_groups`."""
        return self.write_step(step, rows_from_groups(step, groups))


def read_rollouts(run_dir: str | os.PathLike[str], columns: Iterable[str] | None = None) -> pa.Table:
    """All steps' rows as one table, sorted by step (empty table with :data:`SCHEMA` if none)."""
    root = Path(run_dir) / ROLLOUT_DIR
    files = sorted(root.glob("step_*.parquet")) if root.is_dir() else []
    cols = list(columns) if columns is not None else None
    if not files:
        empty = SCHEMA.empty_table()
        return empty.select(cols) if cols else empty
    import pyarrow.dataset as ds  # only readers need it (it imports pandas where installed: ~1 s of start-up)

    table = ds.dataset([str(f) for f in files], schema=SCHEMA, format="parquet").to_table(columns=cols)
    return table.sort_by("step") if "step" in table.column_names else table
