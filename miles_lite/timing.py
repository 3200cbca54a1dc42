"""Wall seconds per named phase: a step's phases (the driver's `time/<phase>_seconds`) and a weight push's
(`sync/phase_<name>_seconds`). A library: any layer may use it."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager


class PhaseTimer:
    """Wall seconds per phase, in the order the phases first ended; a phase entered again adds to its seconds."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def stats(self) -> dict[str, float]:
        """A step's phases as `time/<phase>_seconds`, and their sum as `time/step_seconds`."""
        out = {f"time/{k}_seconds": v for k, v in self.seconds.items()}
        out["time/step_seconds"] = sum(self.seconds.values())
        return out
