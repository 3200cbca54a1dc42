"""A reward model behind HTTP, in the protocol `miles_lite.rewards.remote` speaks.

It stands in for a learned judge: a completion scores 1.0 when the last number it writes equals the
reference answer, else 0.0. Run it with ``python -m miles_plugins.reward_server --port 8123`` and set
``rewards.remote.url=http://HOST:8123/score``.
"""

from __future__ import annotations

import argparse
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def judge(completion: str, answer: float | None) -> float:
    if answer is None:  # a record whose label is not a number
        return 0.0
    numbers = _NUMBER.findall(completion)
    if not numbers:
        return 0.0
    try:
        return 1.0 if float(numbers[-1].replace(",", "")) == float(answer) else 0.0
    except ValueError:
        return 0.0


class RewardHandler(BaseHTTPRequestHandler):
    """POST /score: {"ids", "completions", "answers", ...} -> {"ids", "scores"}."""

    server: RewardServer

    def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
        length = int(self.headers.get("Content-Length", 0))
        try:
            body = json.loads(self.rfile.read(length))
            ids, completions, answers = body["ids"], body["completions"], body["answers"]
        except (ValueError, KeyError, TypeError):
            self._send(400, {"error": "expected JSON with ids, completions, answers"})
            return
        status = self.server.before_scoring(ids)
        if status != 200:
            self._send(status, {"error": "injected failure"})
            return
        self.server.bodies.append(body)
        scores = [judge(c, a) for c, a in zip(completions, answers, strict=True)]
        self._send(200, {"ids": ids, "scores": scores})

    def _send(self, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: object) -> None:  # quiet: one line per request is noise
        pass


class RewardServer(ThreadingHTTPServer):
    """The server; records every id it scored (so a test can check nothing was scored twice) and can fail
    the first `fail_first` requests with HTTP 503."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], fail_first: int = 0) -> None:
        super().__init__(address, RewardHandler)
        self.fail_first = fail_first
        self.scored_ids: list[str] = []
        # Every request body scored (records' prompts, labels, sources and columns included).
        self.bodies: list[dict] = []
        self.requests = 0
        self._lock = threading.Lock()

    def before_scoring(self, ids: list[str]) -> int:
        with self._lock:
            self.requests += 1
            if self.requests <= self.fail_first:
                return 503
            self.scored_ids.extend(ids)
            return 200

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}/score"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--fail-first", type=int, default=0, help="answer the first N requests with 503")
    args = parser.parse_args()
    server = RewardServer((args.host, args.port), fail_first=args.fail_first)
    print(f"reward server on {server.url}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
