"""Graceful stop on SIGUSR1/SIGTERM: Slurm's pre-emption warning, `kubectl delete`, `scancel --signal`.

Light on purpose (no torch import), so the CLI can install it before loading the heavy modules.
"""

from __future__ import annotations

import signal
from typing import Any


class StopRequest:
    """Set by SIGUSR1/SIGTERM; the loop checks it between steps (a step is never cut in half)."""

    def __init__(self) -> None:
        self.signal: int | None = None
        self._previous: dict[int, Any] = {}

    def install(self) -> StopRequest:
        for sig in (signal.SIGUSR1, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        self.signal = signum
        print(f"miles-lite: received {signal.Signals(signum).name}; stopping after this step with a checkpoint",
              flush=True)

    @property
    def requested(self) -> bool:
        return self.signal is not None

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
