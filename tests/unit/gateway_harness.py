"""A session gateway over scripted engines, for tests: the project's offline tokenizer with the qwen2.5 tool tags,
engines that answer by script and record every request, a manager and a gateway on an event-loop thread."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miles_lite.config.schema import FaultToleranceConfig, RolloutConfig
from miles_lite.data.tokenizer import load_or_build_tokenizer
from miles_lite.formats.chat import load_chat_template
from miles_lite.rollout.fleet import EngineFleet, EngineHandle
from miles_lite.rollout.gateway.server import Gateway
from miles_lite.rollout.gateway.turns import TurnRunner
from miles_lite.rollout.manager import RolloutManager
from miles_lite.rollout.sync_api import EventLoopThread
from miles_lite.types import Generation, SamplingParams

KEY = "test-run-key-0123456789abcdef"
TABLE = {"kiwi": "plum", "plum": "7", "fig": "3"}


def call_text(key: str) -> str:
    return f'<tool_call>\n{{"name": "lookup", "arguments": {{"key": "{key}"}}}}\n</tool_call>'


class ScriptEngine:
    """Follows the lookup chain: a question or a tool result naming a key in TABLE is answered by a lookup call of
    it; a value not in TABLE is the answer. Records (input ids, output ids) of every request."""

    def __init__(self, engine_id: str, tokenizer: Any) -> None:
        self.engine_id, self.url, self.tok = engine_id, f"fake://{engine_id}", tokenizer
        self.requests: list[tuple[list[int], list[int]]] = []
        self.eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.dead = False
        self.delay_s = 0.0

    def _reply(self, text: str) -> str:
        last = text.rsplit("<|im_start|>", 2)[-2]  # the turn before the generation prompt
        if "<tool_response>" in last:
            value = last.split("<tool_response>\n")[-1].split("\n</tool_response>")[0]
        else:
            value = last.split("\n", 1)[1].split("<|im_end|>")[0].rstrip("?")
        return call_text(value) if value in TABLE else f"The answer is {value}."

    async def generate(self, input_ids, sampling: SamplingParams, *, rid=None, **kw) -> Generation:
        if self.dead:
            raise ConnectionRefusedError(f"{self.url}: connection refused")
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        text = self.tok.decode(input_ids)
        out = list(self.tok(self._reply(text), add_special_tokens=False)["input_ids"]) + [self.eos]
        out = out[:sampling.max_new_tokens]
        self.requests.append((list(input_ids), out))
        reason = "stop" if out and out[-1] == self.eos else "length"
        routed = None
        if kw.get("return_routed_experts"):  # a MoE engine's expert ids: 2 layers x top-2, per position it ran
            import numpy as np

            rows = len(input_ids) + len(out) - 1
            routed = (np.arange(rows * 4, dtype=np.int32) // 4 + np.tile(np.arange(4, dtype=np.int32), rows)) % 8
        return Generation(tuple(out), tuple(-0.25 for _ in out), reason, "1", self.engine_id, routed_experts=routed)

    async def health(self, timeout_s: float) -> bool:
        return not self.dead

    async def abort(self, rid=None) -> None:
        return None

    async def close(self) -> None:
        return None


@dataclass
class Harness:
    loop: EventLoopThread
    fleet: EngineFleet
    manager: RolloutManager
    gateway: Gateway
    engines: list[ScriptEngine]
    tokenizer: Any
    extra: dict[str, Any] = field(default_factory=dict)

    def open_session(self, **body: Any) -> dict[str, Any]:
        import urllib.request

        req = urllib.request.Request(f"{self.gateway.url}/sessions", data=json.dumps(body).encode(), method="POST",
                                     headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
        with urllib.request.urlopen(req) as resp:
            return json.loads(resp.read())

    def record(self, sid: str, key: str = KEY) -> dict[str, Any]:
        import urllib.request

        req = urllib.request.Request(f"{self.gateway.url}/sessions/{sid}", headers={"Authorization": f"Bearer {key}"})
        with urllib.request.urlopen(req) as resp:
            return json.loads(resp.read())


def tokenizer(cache: Path) -> Any:
    return load_or_build_tokenizer(cache, vocab_size=512, extra_tags=load_chat_template("qwen2.5").tags)


@contextmanager
def harness(cache: Path, engines: int = 1, branch: bool = False, **rollout: Any) -> Iterator[Harness]:
    tok = tokenizer(cache)
    loop = EventLoopThread().start()
    ft = FaultToleranceConfig(health_interval_s=60, request_retries=2, failure_threshold=1, max_engine_restarts=0)
    cfg = RolloutConfig(**{"group_size": 2, "max_new_tokens": 400, **rollout})
    scripted = [ScriptEngine(f"engine-{i}", tok) for i in range(engines)]

    async def build() -> tuple[EngineFleet, RolloutManager, Gateway]:
        fleet = EngineFleet(ft)
        for engine in scripted:
            await fleet.add_engine(EngineHandle(engine))
        manager = RolloutManager(fleet, cfg, ft, decode=tok.decode, encode=lambda t: tok(t)["input_ids"])
        gateway = Gateway(TurnRunner(manager), load_chat_template("qwen2.5"),
                          lambda t: list(tok(t, add_special_tokens=False)["input_ids"]), tok.decode, api_key=KEY,
                          defaults=manager.default_sampling, branch=branch)
        await gateway.start()
        return fleet, manager, gateway

    fleet, manager, gateway = loop.run(build())
    try:
        yield Harness(loop, fleet, manager, gateway, scripted, tok)
    finally:
        loop.run(gateway.stop())
        loop.run(fleet.close())
        loop.stop()
