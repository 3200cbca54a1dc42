"""Graceful stop on SIGUSR1/SIGTERM/SIGINT: Slurm's pre-emption warning, `kubectl delete`, `scancel
--signal`, Ctrl-C.

The loops check `StopRequest.requested` after every RL step and every warm-up step; an RL run then
saves a checkpoint and exits 0. A second SIGINT aborts at once (KeyboardInterrupt), for a user who
does not want to wait for the step to end.

Light on purpose (no torch import), so the CLI can install it before loading the heavy modules.
"""

from __future__ import annotations

import signal
from typing import Any

SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)


class StopRequest:
    """Set by SIGUSR1/SIGTERM/SIGINT; the loops check it between steps (a step is never cut in half)."""

    def __init__(self) -> None:
        self.signal: int | None = None
        self._previous: dict[int, Any] = {}

    def install(self) -> StopRequest:
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if signum == signal.SIGINT and self.signal is not None:
            print("miles-lite: second interrupt; aborting now", flush=True)
            raise KeyboardInterrupt
        first = self.signal is None
        self.signal = signum
        if first:
            again = " (Ctrl-C again aborts at once)" if signum == signal.SIGINT else ""
            print(f"miles-lite: received {self.name}; stopping after this step{again}", flush=True)

    @property
    def requested(self) -> bool:
        return self.signal is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signal).name if self.signal is not None else ""

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
