"""A small HTTP server for metrics scrapes: one thread, one event loop, whatever the number of connections.

The trainer's step must not slow down because something scrapes its exporter often or holds connections
open, so the server
- serves every connection on one asyncio loop (no thread per connection);
- closes a connection that has not sent its whole request within `header_timeout_s` (idle or half-open), or
  does not take the answer within `write_timeout_s`, and holds at most `max_connections` at once;
- renders the exposition text at most once per `min_render_interval_s`: scrapes arriving meanwhile share the
  next rendering, which starts after they arrived, so each answer still holds every value set before its
  request came in. A flood of scrapes costs at most a rendering per interval, not one per request.
GET (or HEAD) of `path` gets the metrics, other paths 404 and other methods 405 (read-only); then the
connection closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

# (Accept header) -> (body, content type)
Render = Callable[[str], tuple[bytes, str]]
MAX_HEAD_BYTES = 16 << 10


@dataclass(frozen=True)
class ScrapeLimits:
    """Timeouts (seconds), the connection cap and the shortest interval between two renderings."""

    header_timeout_s: float = 10.0
    write_timeout_s: float = 10.0
    max_connections: int = 512
    min_render_interval_s: float = 0.05


class _Renderings:
    """Coalesced renderings per Accept header: a request waits for one that starts after it arrived."""

    def __init__(self, render: Render, min_interval_s: float) -> None:
        self.render = render
        self.min_interval_s = min_interval_s
        self.count = 0
        self._last: dict[str, tuple[float, tuple[bytes, str]]] = {}
        self._pending: dict[str, asyncio.Future[tuple[bytes, str]]] = {}

    async def get(self, accept: str, arrived: float) -> tuple[bytes, str]:
        last = self._last.get(accept)
        if last is not None and last[0] >= arrived:
            return last[1]
        pending = self._pending.get(accept)
        if pending is None:
            pending = self._pending[accept] = asyncio.get_running_loop().create_future()
            asyncio.ensure_future(self._run(accept, pending, last[0] if last else None))
        return await asyncio.shield(pending)

    async def _run(self, accept: str, fut: asyncio.Future[tuple[bytes, str]], previous: float | None) -> None:
        if previous is not None:
            wait = previous + self.min_interval_s - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)  # the rate bound itself
        # Whoever is waiting now arrived before this moment: the rendering below covers them all.
        del self._pending[accept]
        started = time.monotonic()
        try:
            result = self.render(accept)
        except Exception as exc:  # the scrape fails; the next one renders again
            fut.set_exception(exc)
            return
        self.count += 1
        self._last[accept] = (started, result)
        fut.set_result(result)


class ScrapeServer:
    """Serves `render(accept)` over HTTP on a bound, listening socket, from one daemon thread.

    `on_request()` is called as each request arrives and returns a token; `on_served(token)` once its answer
    has been written completely.
    """

    def __init__(self, sock: socket.socket, render: Render, on_request: Callable[[], int],
                 on_served: Callable[[int], None], limits: ScrapeLimits | None = None,
                 path: str = "/metrics") -> None:
        self.sock = sock
        self.path = path
        self.limits = limits or ScrapeLimits()
        self.renderings = _Renderings(render, self.limits.min_render_interval_s)
        self._on_request = on_request
        self._on_served = on_served
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.Server | None = None
        self._open = 0
        self._thread = threading.Thread(target=self._main, name="metrics-exporter", daemon=True)
        self._started = threading.Event()
        self._error: BaseException | None = None

    @property
    def open_connections(self) -> int:
        return self._open

    def _main(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._server = self._loop.run_until_complete(
                asyncio.start_server(self._handle, sock=self.sock, limit=MAX_HEAD_BYTES))
        except BaseException as exc:  # reported by start()
            self._error = exc
            self._started.set()
            return
        self._started.set()
        self._loop.run_forever()

    def start(self, timeout_s: float = 10.0) -> None:
        self._thread.start()
        if not self._started.wait(timeout_s):
            raise RuntimeError(f"metrics server did not start within {timeout_s}s")
        if self._error is not None:
            raise self._error

    def stop(self, timeout_s: float = 5.0) -> None:
        async def close() -> None:
            if self._server is not None:
                self._server.close()
            current = asyncio.current_task()
            rest = [t for t in asyncio.all_tasks() if t is not current]
            for task in rest:
                task.cancel()
            await asyncio.gather(*rest, return_exceptions=True)

        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(close(), self._loop).result(timeout_s)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout_s)
        self._loop.close()
        self.sock.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._open += 1
        try:
            if self._open > self.limits.max_connections:
                return  # over the cap: closed at once, the scraper retries on its next interval
            await self._serve_one(reader, writer)
        except (TimeoutError, ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass  # idle, half-open or gone: just close
        except asyncio.CancelledError:
            # Only `stop` cancels a connection's task. End it normally: Python 3.11's stream server logs a
            # traceback for every connection task that ends cancelled.
            pass
        finally:
            self._open -= 1
            writer.close()
            with contextlib.suppress(Exception, asyncio.CancelledError):  # the same, during the close
                await asyncio.wait_for(writer.wait_closed(), 1.0)

    async def _serve_one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self.limits.header_timeout_s)
        arrived = time.monotonic()
        lines = head.decode("latin-1").split("\r\n")
        method, _, rest = lines[0].partition(" ")
        path = rest.split(" ", 1)[0].split("?", 1)[0]
        headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
        refusal = None
        if method not in ("GET", "HEAD"):  # read-only
            refusal = b"405 Method Not Allowed\r\nAllow: GET, HEAD"
        elif path != self.path:
            refusal = b"404 Not Found"
        if refusal is not None:
            writer.write(b"HTTP/1.1 " + refusal + b"\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            await asyncio.wait_for(writer.drain(), self.limits.write_timeout_s)
            return
        token = self._on_request() if method == "GET" else None
        body, content_type = await self.renderings.get(headers.get("accept", ""), arrived)
        writer.write(f"HTTP/1.1 200 OK\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
                     "Connection: close\r\n\r\n".encode("latin-1") + (body if method == "GET" else b""))
        await asyncio.wait_for(writer.drain(), self.limits.write_timeout_s)
        if token is not None:
            self._on_served(token)
