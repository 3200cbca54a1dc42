"""A real Prometheus server for tests: installed from Debian when missing, started on loopback, stopped by pid.

Timing (Debian's 2.42 on a 2-core VM): ready in < 0.2 s; the first scrape is queryable about 6 s
after start because target discovery is throttled to 5 s, so waits poll for up to tens of seconds.
"""

from __future__ import annotations

import enum
import json
import os
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from miles_lite.net.ports import LOCAL_HOST, free_port

APT_ENV = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}


class PrometheusUnavailable(RuntimeError):
    """Prometheus is not installed and cannot be installed here (no apt-get or not root)."""


def ensure_prometheus_installed(timeout_s: float = 600.0) -> tuple[str, str]:
    """Paths of ``prometheus`` and ``promtool``, installing Debian's ``prometheus`` package if needed.

    Raises:
        PrometheusUnavailable: not installed and apt-get is missing or we are not root.
        subprocess.CalledProcessError: apt-get itself failed (its output is in the exception).
    """
    prom, tool = shutil.which("prometheus"), shutil.which("promtool")
    if prom and tool:
        return prom, tool
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        raise PrometheusUnavailable("prometheus is not installed and apt-get is unavailable or not root; "
                                    "install Debian's 'prometheus' package")
    install = ["apt-get", "install", "-y", "--no-install-recommends", "-o", "DPkg::Lock::Timeout=300", "prometheus"]
    done = subprocess.run(install, env=APT_ENV, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        # A fresh machine may have empty package lists.
        subprocess.run(["apt-get", "update"], env=APT_ENV, capture_output=True, text=True, timeout=timeout_s,
                       check=True)
        subprocess.run(install, env=APT_ENV, capture_output=True, text=True, timeout=timeout_s, check=True)
    prom, tool = shutil.which("prometheus"), shutil.which("promtool")
    if not (prom and tool):
        raise PrometheusUnavailable("apt-get installed 'prometheus' but prometheus/promtool are not on PATH")
    return prom, tool


def scrape_config(targets: list[str], interval: str = "1s") -> str:
    """prometheus.yml scraping `targets` (``host:port``) every `interval` (a Prometheus duration: 1s, 250ms)
    under job ``miles-lite``."""
    quoted = ", ".join(json.dumps(t) for t in targets)
    return (f"global: {{scrape_interval: {interval}, evaluation_interval: {interval}}}\n"
            "scrape_configs:\n"
            "  - job_name: miles-lite\n"
            f"    scrape_interval: {interval}\n"
            f"    static_configs: [{{targets: [{quoted}]}}]\n")


class ServerState(enum.Enum):
    NEW = "new"
    RUNNING = "running"
    STOPPED = "stopped"


class PrometheusServer:
    """One ``prometheus`` process on 127.0.0.1 with its own config and TSDB under `workdir`."""

    def __init__(self, workdir: Path, targets: list[str], binary: str, promtool: str,
                 scrape_interval: str = "1s") -> None:
        self.workdir = workdir
        self.config_path = workdir / "prometheus.yml"
        self.config_path.write_text(scrape_config(targets, scrape_interval))
        self.binary = binary
        self.promtool = promtool
        self.port = free_port(LOCAL_HOST)
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.state = ServerState.NEW
        self._proc: subprocess.Popen[bytes] | None = None
        self._log = workdir / "prometheus.log"

    def check_config(self) -> str:
        """``promtool check config``; returns its output, raises CalledProcessError on a bad config."""
        done = subprocess.run([self.promtool, "check", "config", str(self.config_path)], capture_output=True,
                              text=True, timeout=60, check=True)
        return done.stdout + done.stderr

    def start(self, ready_timeout_s: float = 30.0) -> None:
        """Start the server and wait until ``/-/ready`` answers 200."""
        if self.state is not ServerState.NEW:
            raise RuntimeError(f"prometheus server is {self.state.value}")
        with self._log.open("wb") as log:
            self._proc = subprocess.Popen(
                [self.binary, f"--config.file={self.config_path}", f"--storage.tsdb.path={self.workdir / 'data'}",
                 f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
                stdout=log, stderr=subprocess.STDOUT)
        self.state = ServerState.RUNNING
        self.wait_for(lambda: self._get("/-/ready", raw=True) is not None, ready_timeout_s, "/-/ready")

    def stop(self, timeout_s: float = 10.0) -> None:
        """Terminate the process started by :meth:`start` (SIGKILL after `timeout_s`)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(timeout_s)
        self.state = ServerState.STOPPED

    def log_tail(self, chars: int = 3000) -> str:
        return self._log.read_text(errors="replace")[-chars:] if self._log.exists() else ""

    def _get(self, path: str, params: dict[str, str] | None = None, raw: bool = False) -> Any:
        if self._proc is not None and self._proc.poll() is not None:
            raise RuntimeError(f"prometheus exited with {self._proc.returncode}:\n{self.log_tail()}")
        url = self.base_url + path + ("?" + urllib.parse.urlencode(params) if params else "")
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                body = resp.read()
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return None
        return body if raw else json.loads(body)

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        """Instant query through ``/api/v1/query``, evaluated now or at unix time `at` (seconds).

        Returns the result vector (a matrix for a range selector such as ``m[5m]``).

        Raises:
            RuntimeError: the server is down or answered an error (bad PromQL names the expression).
        """
        params = {"query": expr} if at is None else {"query": expr, "time": f"{at:.3f}"}
        url = self.base_url + "/api/v1/query?" + urllib.parse.urlencode(params)
        try:
            with urllib.request.urlopen(url, timeout=10) as resp:
                answer = json.loads(resp.read())
        except urllib.error.HTTPError as err:
            raise RuntimeError(f"query {expr!r} failed: {err.code} {err.read().decode(errors='replace')}") from err
        if answer.get("status") != "success":
            raise RuntimeError(f"query {expr!r} failed: {answer}")
        return answer["data"]["result"]

    def raw_samples(self, selector: str, window: str = "15m") -> list[tuple[float, float]]:
        """(unix time, value) of every scraped sample of the one series `selector` selects in `window`.

        Raises:
            RuntimeError: `selector` matches more than one series.
        """
        result = self.query(f"{selector}[{window}]")
        if len(result) > 1:
            raise RuntimeError(f"{selector} matches {len(result)} series; narrow its labels")
        return [(float(t), float(v)) for t, v in result[0]["values"]] if result else []

    def label_values(self, label: str, match: str) -> list[str]:
        """``/api/v1/label/<label>/values?match[]=<match>`` (what Grafana's label_values() runs)."""
        answer = self._get(f"/api/v1/label/{label}/values", {"match[]": match})
        if not answer or answer.get("status") != "success":
            raise RuntimeError(f"label values of {label} for {match} failed: {answer}")
        return list(answer["data"])

    def targets_health(self) -> list[str]:
        answer = self._get("/api/v1/targets", {"state": "active"}) or {}
        return [t.get("health", "") for t in answer.get("data", {}).get("activeTargets", [])]

    def wait_for(self, condition: Callable[[], bool], timeout_s: float, what: str, poll_s: float = 0.2) -> None:
        """Poll `condition` until it holds; TimeoutError names `what` and includes the server log."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if condition():
                return
            time.sleep(poll_s)
        raise TimeoutError(f"prometheus: {what} not reached within {timeout_s:.0f} s\n{self.log_tail()}")
