"""HTTP endpoint serving a `MetricsRegistry` at ``/metrics`` for Prometheus to scrape.

The server (scrape_server.py) answers every connection from one thread and renders the exposition text at
most once per short interval, so scrapes, however many, neither hold a thread each nor slow the step; idle
and half-open connections are closed. It is kept as an object so it can be shut down (tests, role restarts)
instead of living until the process exits. It counts the scrapes
it has served, so a finished run can keep serving until its final values have been read
(:meth:`MetricsExporter.wait_for_scrape`, ``observability.linger_s``) instead of vanishing between two
scrapes with its last step unrecorded.

The exporter is read-only: it answers GET (and HEAD) of `/metrics` alone; other methods get 405 and other
paths 404. `observability.metrics_host` is the address it binds: 127.0.0.1 for local runs, `node` for this
node's own address (`bind_address`), or any address.
"""

from __future__ import annotations

import enum
import socket
import threading
import time
from typing import TYPE_CHECKING

from prometheus_client.exposition import choose_encoder

from miles_lite.net.ports import AddressError, is_loopback, ray_node_address, route_address
from miles_lite.observability.metrics import MetricsRegistry
from miles_lite.observability.scrape_server import ScrapeLimits, ScrapeServer

# `observability.metrics_host` value for this node's own address.
NODE = "node"
METRICS_PATH = "/metrics"
# A documentation address (TEST-NET-1): routing toward it selects the default route; no packet is sent.
DEFAULT_ROUTE_PROBE = "192.0.2.1"

if TYPE_CHECKING:  # the config package pulls in Hydra; runtime code needs only the fields
    from miles_lite.config.schema import ObservabilityConfig


def bind_address(host: str) -> str:
    """`host`, or for `node` this node's address: its Ray node's, else what its host name resolves to, else
    (a name mapped to loopback, as Debian's /etc/hosts does) the source address of its default route."""
    if host != NODE:
        return host
    address = ray_node_address()
    if address:
        return address
    try:
        address = socket.gethostbyname(socket.gethostname())
    except OSError:
        address = ""
    if address and not is_loopback(address):
        return address
    try:
        address = route_address(DEFAULT_ROUTE_PROBE)
    except AddressError:
        address = ""
    if not address or is_loopback(address):
        raise AddressError("observability.metrics_host=node: this host's name resolves to no routable address and "
                           "it has no default route; set observability.metrics_host to the address Prometheus scrapes")
    return address


class ExporterState(enum.Enum):
    """Lifecycle: NEW -> RUNNING -> STOPPED (a stopped exporter cannot be restarted)."""

    NEW = "new"
    RUNNING = "running"
    STOPPED = "stopped"


class MetricsExporter:
    """Serves `registry` on ``host:port``; port 0 binds a free port (see :attr:`port` after start)."""

    def __init__(self, registry: MetricsRegistry, host: str = "127.0.0.1", port: int = 0,
                 limits: ScrapeLimits | None = None) -> None:
        if not 0 <= port <= 65535:
            raise ValueError(f"observability.metrics_port={port} is not a TCP port; use 0..65535 (0 = any free port)")
        if not host:
            raise ValueError("observability.metrics_host is empty; use 127.0.0.1, node or an address")
        self._registry = registry
        self._host = host
        self._requested_port = port
        self._limits = limits or ScrapeLimits()
        self._server: ScrapeServer | None = None
        # Scrapes are numbered as they start; a scrape counts as served once its body is written.
        self._scrape_cond = threading.Condition()
        self._scrapes_started = 0
        self._last_served = 0
        self.state = ExporterState.NEW

    @property
    def port(self) -> int:
        """The bound TCP port (only while running)."""
        if self._server is None:
            raise RuntimeError(f"exporter is {self.state.value}; start() it to get its port")
        return int(self._server.sock.getsockname()[1])

    @property
    def url(self) -> str:
        """``http://host:port/metrics`` of the running exporter."""
        return f"http://{self._host}:{self.port}/metrics"

    @property
    def scrapes_served(self) -> int:
        """Number of the newest scrape whose response was written completely (0: none yet)."""
        with self._scrape_cond:
            return self._last_served

    def _render(self, accept: str) -> tuple[bytes, str]:
        encoder, content_type = choose_encoder(accept)
        return encoder(self._registry.registry), content_type

    def _request(self) -> int:
        with self._scrape_cond:
            self._scrapes_started += 1
            return self._scrapes_started

    @property
    def renders(self) -> int:
        """How many times the exposition text was rendered (scrapes arriving together share one)."""
        return self._server.renderings.count if self._server is not None else 0

    def _served(self, index: int) -> None:
        with self._scrape_cond:
            self._last_served = max(self._last_served, index)
            self._scrape_cond.notify_all()

    def start(self) -> int:
        """Bind and serve in a daemon thread; returns the bound port.

        Raises:
            RuntimeError: already started or stopped.
            OSError: the port is taken (the message names host and port).
        """
        if self.state is not ExporterState.NEW:
            raise RuntimeError(f"exporter is {self.state.value}; create a new MetricsExporter to serve again")

        # IPv6 literals (``::``) need an AF_INET6 socket; names and IPv4 addresses keep AF_INET.
        family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self._host, self._requested_port))
            sock.listen(128)
            sock.setblocking(False)
        except OSError as err:
            sock.close()
            raise OSError(err.errno, f"cannot serve metrics on {self._host}:{self._requested_port}: {err.strerror}; "
                                     "set observability.metrics_port to a free port or 0") from err
        self._server = ScrapeServer(sock, self._render, self._request, self._served, self._limits, METRICS_PATH)
        self._server.start()
        self.state = ExporterState.RUNNING
        return self.port

    def wait_for_scrape(self, timeout_s: float) -> bool:
        """Block until a scrape that started after this call has been served completely.

        Used at the end of a run so that the scraper records the final values: it returns after at
        most one scrape interval when something scrapes the exporter.

        Args:
            timeout_s: the longest wait in seconds (>= 0).

        Returns:
            True when such a scrape was served, False when `timeout_s` passed first.

        Raises:
            ValueError: a negative `timeout_s`.
            RuntimeError: the exporter is not running.
        """
        if timeout_s < 0:
            raise ValueError(f"observability.linger_s must be >= 0 seconds, got {timeout_s}")
        if self.state is not ExporterState.RUNNING:
            raise RuntimeError(f"exporter is {self.state.value}; only a running exporter can be scraped")
        deadline = time.monotonic() + timeout_s
        with self._scrape_cond:
            after = self._scrapes_started
            while self._last_served <= after:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._scrape_cond.wait(left)
        return True

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop serving and close the socket; a no-op unless running."""
        if self.state is not ExporterState.RUNNING or self._server is None:
            self.state = ExporterState.STOPPED
            return
        self._server.stop(timeout_s)
        self._server = None
        self.state = ExporterState.STOPPED

    def __enter__(self) -> MetricsExporter:
        if self.state is ExporterState.NEW:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_exporter(registry: MetricsRegistry, cfg: ObservabilityConfig) -> MetricsExporter | None:
    """Start an exporter on ``cfg.metrics_host:cfg.metrics_port``, or None when metrics are disabled."""
    if not cfg.metrics_enabled:
        return None
    if cfg.linger_s < 0:
        raise ValueError(f"observability.linger_s={cfg.linger_s} must be >= 0 seconds (0: stop at the end at once)")
    exporter = MetricsExporter(registry, bind_address(cfg.metrics_host), cfg.metrics_port)
    exporter.start()
    return exporter
