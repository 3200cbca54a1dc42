"""Follow the file that lists a job's engines (`rollout.engine_urls_file`), so a running fleet grows and shrinks
with it: the Kubernetes operator rewrites that list (a ConfigMap key mounted into the trainer pod) when
spec.rollout.engines is edited, and the trainer keeps running.

- A URL that appears is awaited until it answers its health check (up to `rollout.startup_timeout_s`) and
  admitted; an engine added while training serves only after a push of the current weights.
- A URL that disappears retires its engine: no more requests, pushes or replacements, and a replacement
  already being awaited for it is dropped without using up a restart.
Adds run one at a time, in the file's order, so engine ids follow the fleet's slot indexes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path

from miles_lite.rollout.engine import RolloutEngine
from miles_lite.rollout.engine_state import EngineHandle, EngineState
from miles_lite.rollout.fleet import EngineFleet

# connect(slot index, url, still wanted?) -> a client once the engine answers its health check; raises
# TimeoutError, or EngineUnlisted once `still wanted` turns False.
Connect = Callable[[int, str, Callable[[], bool]], Awaitable[RolloutEngine]]

logger = logging.getLogger(__name__)


def read_engine_list(path: str | Path) -> list[str] | None:
    """The URLs listed in `path` (one per line; blank lines and # comments skipped), in order and without
    repeats; None when the file cannot be read (a ConfigMap volume between updates keeps the last list)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError:
        return None
    urls: list[str] = []
    for line in text.splitlines():
        url = line.strip().rstrip("/")
        if url and not url.startswith("#") and url not in urls:
            urls.append(url)
    return urls


class EngineListFollower:
    """Keeps `fleet` equal to the engines listed in `path`; `urls[i]` is the URL of the fleet's slot i (the list
    the fleet's reattach launcher reads, so a dead engine's replacement is awaited at its own URL)."""

    def __init__(self, fleet: EngineFleet, connect: Connect, urls: list[str], path: str | Path,
                 poll_s: float = 2.0) -> None:
        if poll_s <= 0:
            raise ValueError(f"engine list poll period must be > 0 s, got {poll_s}")
        self.fleet = fleet
        self.connect = connect
        self.urls = urls
        self.path = Path(path)
        self.poll_s = poll_s
        self.listed: set[str] | None = None
        self._to_add: list[str] = []
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    def still_listed(self, url: str) -> bool:
        """Whether `url` is in the newest list read (True before the first read)."""
        return self.listed is None or url.rstrip("/") in self.listed

    def _live_urls(self) -> set[str]:
        return {self.urls[r.index] for r in self.fleet.records if r.state is not EngineState.RETIRED}

    async def sync(self) -> None:
        """One pass: retire engines no longer listed, queue the newly listed ones for admission."""
        wanted = read_engine_list(self.path)
        if wanted is None:
            return
        self.listed = set(wanted)
        for rec in list(self.fleet.records):
            url = self.urls[rec.index]
            if rec.state is not EngineState.RETIRED and url not in self.listed:
                logger.info("engine %s (%s) left %s; retiring it", rec.engine_id, url, self.path)
                await self.fleet.retire(rec, f"{url} is no longer in {self.path}")
        live = self._live_urls()
        self._to_add = [u for u in wanted if u not in live]
        if self._to_add:
            self._wake.set()

    async def _admit_queued(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._to_add:
                url = self._to_add.pop(0)
                if url in self._live_urls() or not self.still_listed(url):
                    continue
                index = len(self.fleet.records)
                try:
                    engine = await self.connect(index, url, lambda u=url: self.still_listed(u))
                except (TimeoutError, EngineUnlisted) as err:
                    logger.warning("engine %s not added: %s", url, err)
                    continue
                if not self.still_listed(url) or index != len(self.fleet.records):
                    await engine.close()
                    continue
                # No await between these two: slot `index` and urls[index] name the same engine.
                self.urls.append(url)
                await self.fleet.admit(EngineHandle(engine))

    async def _poll(self) -> None:
        while True:
            try:
                await self.sync()
            except Exception:  # a bad pass must not end the following; the next one retries
                logger.exception("reading the engine list %s failed", self.path)
            await asyncio.sleep(self.poll_s)  # the poll period (a mounted ConfigMap changes without an event)

    def start(self) -> None:
        """Start following (call on the fleet's event loop)."""
        self._tasks = [asyncio.ensure_future(self._poll()), asyncio.ensure_future(self._admit_queued())]

    async def stop(self) -> None:
        """Stop following; engines already admitted stay in the fleet."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []


class EngineUnlisted(RuntimeError):
    """An engine being awaited was removed from the engine list meanwhile."""
