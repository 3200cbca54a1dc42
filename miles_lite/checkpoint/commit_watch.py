"""Follow a checkpoint root's commits: `CommitWatcher` calls back with the step each time `latest` names a newer
committed checkpoint.

Saves commit on the flush thread of trainer rank 0, which may run in another process (a Ray actor) or on
another node: the commit's one visible effect every launcher shares is the `latest` pointer in the checkpoint
root (renamed into place last, `layout.commit`). The watcher reads it every `interval_s` on a daemon thread, so
what reports it (the `miles_lite_checkpoint_step` gauge, hence the operator's `status.lastCheckpoint`) follows
a background commit within that interval, not at the next step or the next save.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

from miles_lite.checkpoint.layout import parse_step, read_latest


def committed_step(root: Path) -> int | None:
    """Step of the checkpoint `latest` names in `root`, when that directory exists (None: none committed)."""
    try:
        name = read_latest(root)
    except OSError:  # a shared filesystem that hiccups: the next read retries
        return None
    if name is None or not (root / name).is_dir():
        return None
    return parse_step(name)


class CommitWatcher:
    """Calls `on_commit(step)` once for the step committed at start (if any) and then for every newer commit."""

    def __init__(self, root: str | Path, on_commit: Callable[[int], None], interval_s: float = 1.0) -> None:
        if interval_s <= 0:
            raise ValueError(f"checkpoint commit watch interval must be > 0 s, got {interval_s}")
        self.root = Path(root)
        self.on_commit = on_commit
        self.interval_s = interval_s
        self.last: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def check(self) -> int | None:
        """Read `latest` once; report a step not reported before. Returns the newest step reported."""
        step = committed_step(self.root)
        if step is not None and step != self.last:
            self.last = step
            self.on_commit(step)
        return self.last

    def start(self) -> CommitWatcher:
        self.check()
        self._thread = threading.Thread(target=self._run, name="checkpoint-commit-watch", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):  # the poll period: a commit is a rename, with no event
            self.check()

    def stop(self) -> None:
        """Stop watching (after a last read, so a commit just before the end is reported)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.check()
