"""Carry the fleet's "starved" signal from the rollout loop to the thread that owns the trainer's weights.

When every healthy engine died during a rollout and a replacement is up but stale, only a push of the
current weights lets the rollout go on, and the regular push comes after the rollout. The fleet (on the
rollout loop) calls `StarvationRelay.signal`; the driver thread, blocked on a rollout result in
`StarvationRelay.wait`, runs `relieve` (a push of the current version to the stale engines) and keeps
waiting. The driver thread is the only one that trains and pushes, and it relieves only while it waits
on a rollout, so a relief push never overlaps a training step or another push. While the driver trains
(async rollouts), the starved rollout simply waits for the push that follows the step.

States of one relay: idle -> requested (signal) -> relieving (a waiting thread took it) -> idle.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

T = TypeVar("T")

logger = logging.getLogger(__name__)


class ReliefState(enum.Enum):
    IDLE = "idle"
    REQUESTED = "requested"
    RELIEVING = "relieving"


class StarvationRelay:
    """See the module docstring. `relieve` runs on the waiting thread; its exceptions end the wait."""

    def __init__(self, relieve: Callable[[], None]) -> None:
        self.relieve = relieve
        self.state = ReliefState.IDLE
        self.reliefs = 0
        self._cond = threading.Condition()

    def signal(self) -> None:
        """Ask for a relief (thread-safe, never blocks); repeated requests before it runs count once."""
        with self._cond:
            if self.state is ReliefState.IDLE:
                self.state = ReliefState.REQUESTED
                self._cond.notify_all()

    def wait(self, fut: Future[T], timeout_s: float | None = None) -> T:
        """`fut.result(timeout_s)`, running `relieve` on this thread whenever a relief is requested."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        fut.add_done_callback(lambda _: self._poke())
        while True:
            with self._cond:
                while not fut.done() and self.state is not ReliefState.REQUESTED:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        break
                    self._cond.wait(left)
                if fut.done() or self.state is not ReliefState.REQUESTED:
                    return fut.result(0)  # done, or raises TimeoutError as Future.result does
                self.state = ReliefState.RELIEVING
            try:
                self.relieve()
                self.reliefs += 1
            finally:
                with self._cond:
                    self.state = ReliefState.IDLE

    def _poke(self) -> None:
        with self._cond:
            self._cond.notify_all()
