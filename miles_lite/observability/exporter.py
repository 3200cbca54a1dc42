"""HTTP endpoint serving a `MetricsRegistry` at ``/metrics`` for Prometheus to scrape.

The server is prometheus_client's threaded WSGI server, kept as an object so it can be shut down
(tests, role restarts) instead of living until the process exits.
"""

from __future__ import annotations

import enum
import threading
from typing import TYPE_CHECKING
from wsgiref.simple_server import WSGIServer

from prometheus_client import start_http_server

from miles_lite.observability.metrics import MetricsRegistry

if TYPE_CHECKING:  # the config package pulls in Hydra; runtime code needs only the fields
    from miles_lite.config.schema import ObservabilityConfig


class ExporterState(enum.Enum):
    """Lifecycle: NEW -> RUNNING -> STOPPED (a stopped exporter cannot be restarted)."""

    NEW = "new"
    RUNNING = "running"
    STOPPED = "stopped"


class MetricsExporter:
    """Serves `registry` on ``host:port``; port 0 binds a free port (see :attr:`port` after start)."""

    def __init__(self, registry: MetricsRegistry, host: str = "127.0.0.1", port: int = 0) -> None:
        if not 0 <= port <= 65535:
            raise ValueError(f"observability.metrics_port={port} is not a TCP port; use 0..65535 (0 = any free port)")
        if not host:
            raise ValueError("observability.metrics_host is empty; use 127.0.0.1 or 0.0.0.0")
        self._registry = registry
        self._host = host
        self._requested_port = port
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None
        self.state = ExporterState.NEW

    @property
    def port(self) -> int:
        """The bound TCP port (only while running)."""
        if self._server is None:
            raise RuntimeError(f"exporter is {self.state.value}; start() it to get its port")
        return int(self._server.server_port)

    @property
    def url(self) -> str:
        """``http://host:port/metrics`` of the running exporter."""
        return f"http://{self._host}:{self.port}/metrics"

    def start(self) -> int:
        """Bind and serve in a daemon thread; returns the bound port.

        Raises:
            RuntimeError: already started or stopped.
            OSError: the port is taken (the message names host and port).
        """
        if self.state is not ExporterState.NEW:
            raise RuntimeError(f"exporter is {self.state.value}; create a new MetricsExporter to serve again")
        try:
            self._server, self._thread = start_http_server(
                self._requested_port, addr=self._host, registry=self._registry.registry)
        except OSError as err:
            raise OSError(err.errno, f"cannot serve metrics on {self._host}:{self._requested_port}: {err.strerror}; "
                                     "set observability.metrics_port to a free port or 0") from err
        self.state = ExporterState.RUNNING
        return self.port

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop serving and close the socket; a no-op unless running."""
        if self.state is not ExporterState.RUNNING or self._server is None:
            self.state = ExporterState.STOPPED
            return
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout_s)
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
    exporter = MetricsExporter(registry, cfg.metrics_host, cfg.metrics_port)
    exporter.start()
    return exporter
