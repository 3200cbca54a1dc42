"""The metrics exporter under a scrape flood and idle connections: one thread whatever the connections, idle
and half-open connections closed, renderings shared between scrapes arriving together (at most one per
interval), and every answer still holding what was set before its request."""

from __future__ import annotations

import re
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator

import pytest

from miles_lite.observability.exporter import MetricsExporter
from miles_lite.observability.metrics import MetricsRegistry
from miles_lite.observability.scrape_server import ScrapeLimits

LIMITS = ScrapeLimits(header_timeout_s=0.5, write_timeout_s=2.0, max_connections=40, min_render_interval_s=0.05)


@pytest.fixture
def exporter() -> Iterator[tuple[MetricsExporter, MetricsRegistry]]:
    reg = MetricsRegistry("r1", "driver")
    exp = MetricsExporter(reg, "127.0.0.1", 0, limits=LIMITS)
    exp.start()
    try:
        yield exp, reg
    finally:
        exp.stop()


def scrape(exp: MetricsExporter) -> str:
    with urllib.request.urlopen(exp.url, timeout=10) as resp:
        assert resp.headers["Content-Type"].startswith("text/plain")
        return resp.read().decode()


def step_of(text: str) -> int:
    match = re.search(r"^miles_lite_step\{[^}]*\} (\S+)$", text, re.M)
    assert match, text[:500]
    return int(float(match.group(1)))


def test_idle_connections_hold_no_thread_and_are_closed(exporter):
    exp, reg = exporter
    reg.publish_step(3, {})
    threads = threading.active_count()
    idle = [socket.create_connection(("127.0.0.1", exp.port)) for _ in range(30)]
    half = socket.create_connection(("127.0.0.1", exp.port))
    half.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # half a request, then silence
    try:
        assert step_of(scrape(exp)) == 3  # served while 31 connections hang
        assert threading.active_count() == threads
        for sock in [*idle, half]:
            sock.settimeout(10 * LIMITS.header_timeout_s)
            started = time.monotonic()
            assert sock.recv(1) == b""  # closed by the exporter
            assert time.monotonic() - started < 10 * LIMITS.header_timeout_s
    finally:
        for sock in [*idle, half]:
            sock.close()
    # Beyond the cap a connection is closed at once; the cap frees as connections end.
    held = [socket.create_connection(("127.0.0.1", exp.port)) for _ in range(LIMITS.max_connections)]
    try:
        deadline = time.monotonic() + 5
        while exp._server is not None and exp._server.open_connections < LIMITS.max_connections:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        extra = socket.create_connection(("127.0.0.1", exp.port))
        extra.settimeout(5)
        assert extra.recv(1) == b""
        extra.close()
    finally:
        for sock in held:
            sock.close()
    assert step_of(scrape(exp)) == 3


def test_scrape_flood_shares_renderings_and_answers_stay_fresh(exporter):
    exp, reg = exporter
    reg.publish_step(1, {})
    errors: list[BaseException] = []
    served = 0
    lock = threading.Lock()

    def flood() -> None:
        nonlocal served
        try:
            for _ in range(15):
                scrape(exp)
                with lock:
                    served += 1
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=flood) for _ in range(12)]
    started = time.monotonic()
    for t in threads:
        t.start()
    # Meanwhile the "trainer" moves on; an answer to a request sent after a step holds that step.
    for step in range(2, 12):
        reg.publish_step(step, {})
        assert step_of(scrape(exp)) >= step
    for t in threads:
        t.join(60)
    elapsed = time.monotonic() - started
    assert not errors and served == 12 * 15
    total = served + 10
    assert exp.renders <= elapsed / LIMITS.min_render_interval_s + 2, (exp.renders, elapsed)
    assert exp.renders < total, (exp.renders, total)
    # The exporter counts a scrape once its write returned, which may be just after the client read it.
    deadline = time.monotonic() + 5
    while exp.scrapes_served < total:
        assert time.monotonic() < deadline, exp.scrapes_served
        time.sleep(0.01)


def test_stop_with_connections_open_ends_them_quietly(caplog):
    reg = MetricsRegistry("r1", "driver")
    exp = MetricsExporter(reg, "127.0.0.1", 0, limits=ScrapeLimits(header_timeout_s=30.0))
    exp.start()
    held = [socket.create_connection(("127.0.0.1", exp.port)) for _ in range(5)]
    try:
        deadline = time.monotonic() + 5
        while exp._server is not None and exp._server.open_connections < len(held):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        with caplog.at_level("ERROR", logger="asyncio"):
            exp.stop()
        assert [r.getMessage() for r in caplog.records if r.name == "asyncio"] == []
        for sock in held:
            sock.settimeout(5)
            assert sock.recv(1) == b""  # closed by the stop
    finally:
        for sock in held:
            sock.close()
