"""What a reward function is called with, in each of the calling conventions it may follow.

- ``math``: ``fn(completions, *, answers, questions, steps)``, the numeric math rewards (a function
  naming the parameters ``answers``, ``questions`` and ``steps`` follows this one);
- ``columns`` (TRL's convention): ``fn(prompts=..., completions=..., completion_ids=..., **columns)``,
  every record column by its own name, each a list aligned with the completions, plus TRL's
  ``trainer_state``, ``log_metric`` and ``log_extra`` (`rewards.context`); the function takes what it
  names plus ``**kwargs``. As in TRL, a conversational record's prompt is its list of messages and its
  completion a list of one assistant message (``[{"role": "assistant", "content": text}]``); a string
  record's prompt and completion are strings;
- ``batch``: ``fn(batch)`` with the whole :class:`RewardBatch` (the built-in record rewards and the
  remote reward model).

A function may return ``None`` for a completion it does not apply to, and may be ``async``.
"""

from __future__ import annotations

import asyncio
import inspect
import math
from collections.abc import Iterable, Mapping, Sequence, Sized
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from miles_lite.plugins import PluginTimeout
from miles_lite.rewards.context import RewardContext

STYLES = ("math", "columns", "batch")
MATH_KEYWORDS = ("answers", "questions", "steps")
FIXED_KEYWORDS = ("prompts", "completions", "completion_ids")
# What TRL's GRPOTrainer passes every reward function besides the batch and the columns.
CONTEXT_KEYWORDS = ("trainer_state", "log_metric", "log_extra")


@dataclass
class RewardBatch:
    """Completions and their records, every list aligned with `completions`.

    `prompts` are the records' prompts as written (a string, or the list of chat messages); `labels`
    the records' labels as they are; `answers` the labels as numbers (NaN when not one); `columns`
    every record column by name (None where a record lacks it). `context` collects what plug-ins log
    (None: a fresh one per call); `rows` are these completions' positions in the batch first scored
    (a `subset` keeps them, so logged values find their completions).
    """

    completions: list[str]
    answers: list[float]
    questions: list[str]
    steps: list[tuple[float, ...]]
    prompts: list[Any] = field(default_factory=list)
    completion_ids: list[list[int]] = field(default_factory=list)
    labels: list[Any] = field(default_factory=list)
    sources: list[str | None] = field(default_factory=list)
    columns: dict[str, list[Any]] = field(default_factory=dict)
    context: RewardContext | None = None
    rows: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        n = len(self.completions)
        self.rows = self.rows or list(range(n))
        self.prompts = self.prompts or list(self.questions)
        self.completion_ids = self.completion_ids or [[] for _ in range(n)]
        self.labels = self.labels or list(self.answers)
        self.sources = self.sources or [None] * n
        for name in ("answers", "questions", "steps", "prompts", "completion_ids", "labels", "sources", "rows"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"{name} has {len(getattr(self, name))} entries but there are {n} completions")
        for name, values in self.columns.items():
            if len(values) != n:
                raise ValueError(f"column {name!r} has {len(values)} entries but there are {n} completions")

    def __len__(self) -> int:
        return len(self.completions)

    def subset(self, indices: Sequence[int]) -> RewardBatch:
        def pick(values: list[Any]) -> list[Any]:
            return [values[i] for i in indices]

        return RewardBatch(pick(self.completions), pick(self.answers), pick(self.questions), pick(self.steps),
                           pick(self.prompts), pick(self.completion_ids), pick(self.labels), pick(self.sources),
                           {k: pick(v) for k, v in self.columns.items()}, self.context, pick(self.rows))

    def trl_completions(self) -> list[Any]:
        """The completions as TRL passes them: one assistant message in a list for a conversational record
        (its prompt is a list of messages), the text itself for a string record."""
        return [[{"role": "assistant", "content": text}] if is_conversational(prompt) else text
                for prompt, text in zip(self.prompts, self.completions, strict=True)]

    def keywords(self) -> dict[str, Any]:
        """The keyword arguments of a `columns`-style call: TRL's GRPOTrainer's, every column by name."""
        context = self.context if self.context is not None else RewardContext()
        return {**self.columns, "prompts": self.prompts, "completions": self.trl_completions(),
                "completion_ids": self.completion_ids, "trainer_state": context.trainer_state,
                "log_metric": context.log_metric, "log_extra": context.extra_logger(self.rows)}


def is_conversational(prompt: Any) -> bool:
    """A prompt in TRL's conversational format: a list of messages (dicts with a role)."""
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict) and "role" in prompt[0]


def batch_from_records(completions: Sequence[str], records: Sequence[Any],
                       completion_ids: Sequence[Sequence[int]] | None = None,
                       context: RewardContext | None = None) -> RewardBatch:
    """A batch of completions of `records` (records or math problems, one per completion)."""
    names: dict[str, None] = {}
    for record in records:
        names.update(dict.fromkeys(record.columns))
    prompts = [_prompt_as_written(r) for r in records]
    return RewardBatch(list(completions), [float(r.answer) for r in records], [r.question for r in records],
                       [tuple(r.steps) for r in records], prompts,
                       [list(c) for c in completion_ids] if completion_ids is not None else [],
                       [r.label for r in records], [r.source for r in records],
                       {name: [r.columns.get(name) for r in records] for name in names}, context)


def _prompt_as_written(record: Any) -> Any:
    """A record's prompt as its data holds it (typed content parts and roles unchanged): what TRL passes."""
    written = getattr(record, "prompt_value", None)
    if written is not None:
        return written
    return [dict(m) for m in record.messages] if record.messages is not None else record.prompt


def with_sample_fields(batch: RewardBatch, fields: Sequence[Mapping[str, Any] | None]) -> RewardBatch:
    """`batch` with per-completion fields (what each sample's agent returned) as columns by their own names;
    they shadow record columns of the same name (None where a completion has no such field)."""
    names = dict.fromkeys(name for f in fields if f for name in f)
    if not names:
        return batch
    for name in names:
        batch.columns[name] = [f.get(name) if f else None for f in fields]
    return batch


def reward_style(fn: Any) -> str:
    """`math` for a function naming `answers`, `questions` and `steps`; else `columns`."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return "columns"
    return "math" if all(k in params for k in MATH_KEYWORDS) else "columns"


def columns_problem(fn: Any, columns: Iterable[str]) -> str | None:
    """Why a `columns`-style function cannot take the keywords of these columns (None when it can): it
    lacks `**kwargs`, or it names a parameter that is neither a column nor one of prompts/completions/ids."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return None
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return "it must accept **kwargs (every record column is passed by name)"
    known = {*columns, *FIXED_KEYWORDS, *CONTEXT_KEYWORDS}
    missing = [name for name, p in params.items()
               if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.default is p.empty and name not in known]
    if missing:
        return f"it asks for {missing}, which the data has no column of (columns: {sorted(set(columns))})"
    return None


def _await(awaitable: Any, timeout_s: float | None = None) -> Any:
    async def wait() -> Any:
        return await asyncio.wait_for(awaitable, timeout_s)

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(wait())
    # Called from inside an event loop by a caller of its own (the rollout manager scores in a worker thread):
    # a loop of its own in a thread, so that this one is not re-entered.
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="async-reward") as pool:
        return pool.submit(asyncio.run, wait()).result()


def _call(fn: Any, style: str, batch: RewardBatch) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The positional and keyword arguments of `fn` in convention `style`."""
    if style == "math":
        return (batch.completions,), {"answers": batch.answers, "questions": batch.questions, "steps": batch.steps}
    if style == "columns":
        return (), batch.keywords()
    if style == "batch":
        return (batch,), {}
    raise ValueError(f"unknown reward calling convention {style!r}; one of {STYLES}")


def call_style(fn: Any, style: str, batch: RewardBatch, timeout_s: float | None = None, pool: Any = None,
               name: str = "reward") -> Any:
    """Call `fn` in its convention and await the result if it is awaitable.

    With a `pool` (`plugins.PluginPool`) a synchronous function runs in the pool's workers (threads or processes)
    and both kinds are bounded by `timeout_s` (PluginTimeout past it); without, it is called here."""
    args, kwargs = _call(fn, style, batch)
    what = f"reward {name!r}"
    if pool is None or inspect.iscoroutinefunction(fn):
        out = fn(*args, **kwargs)
    else:
        out = pool.call(what, fn, args, kwargs, timeout_s)
    if not inspect.isawaitable(out):
        return out
    try:
        return _await(out, timeout_s if pool is not None else None)
    except TimeoutError:
        raise PluginTimeout(what, timeout_s or 0.0) from None


def checked_values(name: str, values: object, n: int) -> list[float]:
    """Raw values of one reward, verified to be exactly ``n`` finite floats or None (NaN in the result)."""
    # Any sized iterable (list, tuple, numpy array) is accepted; text and mappings are not.
    sized_iterable = isinstance(values, Sized) and isinstance(values, Iterable)
    if isinstance(values, str | bytes | Mapping) or not sized_iterable:
        raise ValueError(f"reward {name!r} returned {type(values).__name__}, expected a list of {n} floats")
    values = list(values)
    if len(values) != n:
        raise ValueError(f"reward {name!r} returned {len(values)} values for {n} completions")
    checked = []
    for index, value in enumerate(values):
        if value is None:  # not applicable to this completion
            checked.append(math.nan)
            continue
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ValueError(
                f"reward {name!r} returned {value!r} for completion {index}, expected a float or None"
            ) from None
        if isinstance(value, str) or not math.isfinite(number):
            raise ValueError(
                f"reward {name!r} returned {value!r} for completion {index}, expected a finite float or None"
            )
        checked.append(number)
    return checked
