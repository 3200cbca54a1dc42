"""Graceful stop on SIGUSR1/SIGTERM/SIGINT: Slurm's pre-emption warning, `kubectl delete`, `scancel
--signal`, Ctrl-C.

The loops check `StopRequest.requested` after every RL step and every warm-up step; an RL run then
saves a checkpoint and exits 0. A second SIGINT aborts at once (KeyboardInterrupt, which the driver turns
into `RunAborted` once the roles are stopped; `miles-lite train` exits `EXIT_ABORTED`), for a user who does
not want to wait for the step to end. A third one, while the engines and the trainer shut down, gives
SIGINT back to the system's default: a fourth ends the process at once.

Light on purpose (no torch import), so the CLI can install it before loading the heavy modules.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)
# Exit status of `miles-lite train` aborted by a second Ctrl-C (128 + SIGINT, as shells report it).
EXIT_ABORTED = 128 + signal.SIGINT


class RunAborted(Exception):
    """A second Ctrl-C ended the run mid-step; its roles are stopped. `checkpoint`: the newest committed one
    (where the run continues), None when none was."""

    def __init__(self, run_dir: Path, checkpoint: Path | None) -> None:
        super().__init__(f"aborted by a second Ctrl-C in {run_dir}")
        self.run_dir = run_dir
        self.checkpoint = checkpoint


class StopRequest:
    """Set by SIGUSR1/SIGTERM/SIGINT; the loops check it between steps (a step is never cut in half)."""

    def __init__(self) -> None:
        self.signal: int | None = None
        self.interrupts = 0
        self._previous: dict[int, Any] = {}

    def install(self) -> StopRequest:
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if signum == signal.SIGINT and self.signal is not None:
            self.interrupts += 1
            if self.interrupts == 1:
                print("miles-lite: second interrupt; aborting now (stopping the engines and the trainer)", flush=True)
                raise KeyboardInterrupt
            print("miles-lite: still stopping the engines and the trainer; Ctrl-C again ends the process at once",
                  flush=True)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            return
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
