"""The training prompt stream: a seeded shuffle per epoch and a cursor that checkpoints can restore."""

from __future__ import annotations

import functools
import random
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from miles_lite.data.gsm8k import MathProblem

T = TypeVar("T")


def _locked(method: Callable[..., T]) -> Callable[..., T]:
    """Run the method under the instance's lock (re-entrant: locked methods call each other)."""
    @functools.wraps(method)
    def wrapper(self: PromptSource, *args: Any, **kwargs: Any) -> T:
        with self._lock:
            return method(self, *args, **kwargs)
    return wrapper


class PromptSource:
    """Yields `(index, problem)` pairs epoch after epoch, each epoch in a fresh seeded order.

    `index` is the problem's position in the full data set, stable across epochs, filters and resumes;
    `keep_only` restricts later epochs (and the rest of the current one) to a subset (the presample filter).
    Thread-safe: the driver draws step batches while the rollout thread may draw refill prompts.
    """

    def __init__(self, problems: Sequence[MathProblem], seed: int) -> None:
        if not problems:
            raise ValueError("the training data set is empty; check data.train_path or data.synthetic.train_size")
        self.problems = list(problems)
        self.seed = seed
        self._lock = threading.RLock()
        self.active: list[int] = list(range(len(self.problems)))
        self.epoch = 0
        self.cursor = 0
        self.order = self._shuffled(0)

    def _shuffled(self, epoch: int) -> list[int]:
        order = list(self.active)
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    @_locked
    def keep_only(self, indices: Sequence[int]) -> None:
        """Restrict the stream to `indices` (positions in the full data set) from now on; a second call
        restricts further (an excluded problem never comes back)."""
        keep = set(indices) & set(self.active)
        if not keep:
            raise ValueError("the presample filter left no training questions; lower data.presample.k or "
                             "disable data.presample.drop_all_wrong/drop_all_right")
        self.active = [i for i in range(len(self.problems)) if i in keep]
        rest = [i for i in self.order[self.cursor:] if i in keep]
        self.order, self.cursor = rest, 0
        if not self.order:
            self._next_epoch()

    @_locked
    def exclude(self, indices: Sequence[int]) -> None:
        """Leave `indices` out of the stream from now on (e.g. the SFT warm-up's questions)."""
        drop = set(indices)
        self.keep_only([i for i in self.active if i not in drop])

    def _next_epoch(self) -> None:
        self.epoch += 1
        self.order, self.cursor = self._shuffled(self.epoch), 0

    @_locked
    def next_batch(self, n: int) -> list[tuple[int, MathProblem]]:
        """The next `n` problems, rolling into a new epoch (new order) when one runs out."""
        batch: list[tuple[int, MathProblem]] = []
        taken: set[int] = set()
        # A batch never repeats a problem while the stream has enough distinct ones.
        distinct = len(self.active) >= n
        while len(batch) < n:
            if self.cursor >= len(self.order):
                self._next_epoch()
            index = self.order[self.cursor]
            if distinct and index in taken:
                # Defer it: move it after the next unused one of the new epoch.
                self.order.append(self.order.pop(self.cursor))
                continue
            self.cursor += 1
            taken.add(index)
            batch.append((index, self.problems[index]))
        return batch

    @_locked
    def epochs_done(self) -> float:
        """Passes over the data so far: finished epochs plus the share of the current one drawn."""
        return self.epoch + (self.cursor / len(self.order) if self.order else 0.0)

    @_locked
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue the exact same order after a restart."""
        return {"seed": self.seed, "epoch": self.epoch, "cursor": self.cursor, "order": list(self.order),
                "active": list(self.active)}

    @_locked
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a `state_dict`; the data set must be the same one."""
        if max(state["active"], default=-1) >= len(self.problems):
            raise ValueError("the checkpoint's data cursor refers to more problems than the data set has; "
                             "resume with the same data.* settings")
        self.seed, self.epoch, self.cursor = state["seed"], state["epoch"], state["cursor"]
        self.order, self.active = list(state["order"]), list(state["active"])
