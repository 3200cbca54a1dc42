"""An in-process engine implementing the RolloutEngine protocol, for unit tests of scheduling logic.

Tokens are deterministic: token i of a request is `(seed + len(input_ids) + i) % 97`, with logprob
-(token % 5) / 10, and generation takes `delay_s` per token so requests overlap and can be aborted.
Modes: "ok", "error" (answers an EngineError), "dead" (connection refused), "hang" (never answers).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from miles_lite.rollout.engine import EngineError
from miles_lite.types import Generation, SamplingParams
from miles_lite.weight_sync.transport import EngineLoop, FleetEngine, PushReport, TransportState


class FakeEngine:
    def __init__(self, engine_id: str, *, version: str = "0", delay_s: float = 0.0, mode: str = "ok",
                 max_tokens: int | None = None) -> None:
        self.engine_id = engine_id
        self.url = f"fake://{engine_id}"
        self.version = version
        self.delay_s = delay_s
        self.mode = mode
        self.healthy = True
        # Stop after this many tokens with finish "stop" (None: run to max_new_tokens).
        self.max_tokens = max_tokens
        self.calls: list[tuple[str | None, list[int], SamplingParams]] = []
        self.completed: list[str | None] = []
        self.aborts: list[str | None] = []
        self.paused = False
        self.closed = False
        self._abort_all = 0
        self.adapters: dict[str, str] = {}
        self.tensor_loads: list[tuple[str, dict[str, Any], list[dict[str, Any]]]] = []
        self.lora_name: str | None = None
        self._abort_rids: set[str] = set()
        # Memory tags released (sleeping while any is), and every control call in order (for ordering tests).
        self.released: set[str] = set()
        self.log: list[str] = []
        self.health_probes = 0

    async def generate(self, input_ids: list[int], sampling: SamplingParams, *, rid: str | None = None) -> Generation:
        self.calls.append((rid, list(input_ids), sampling))
        if self.released:
            raise EngineError(f"{self.url}/generate answered 503: memory released {sorted(self.released)}")
        if self.mode == "dead":
            raise ConnectionRefusedError(f"{self.url}: connection refused")
        if self.mode == "error":
            raise EngineError(f"{self.url}/generate answered 500: injected error")
        if self.mode == "hang":
            await asyncio.Event().wait()
        epoch = self._abort_all
        seed = sampling.seed or 0
        limit = sampling.max_new_tokens if self.max_tokens is None else min(self.max_tokens, sampling.max_new_tokens)
        ids: list[int] = []
        for i in range(limit):
            if self.delay_s:
                await asyncio.sleep(self.delay_s)  # simulated decode time of one token
            if self._abort_all != epoch or rid in self._abort_rids:
                return self._gen(ids, "abort")
            ids.append((seed + len(input_ids) + i) % 97)
        self.completed.append(rid)
        reason = "length" if len(ids) == sampling.max_new_tokens else "stop"
        return self._gen(ids, reason)

    def _gen(self, ids: list[int], reason: str) -> Generation:
        return Generation(tuple(ids), tuple(-(t % 5) / 10 for t in ids), reason, self.version, self.engine_id)

    async def score(self, input_ids: list[int], prompt_len: int) -> list[float]:
        return [-(t % 5) / 10 for t in input_ids[prompt_len:]]

    async def health(self, timeout_s: float) -> bool:
        self.health_probes += 1
        if self.mode == "dead":
            raise ConnectionRefusedError(f"{self.url}: connection refused")
        if self.mode == "hang":
            await asyncio.Event().wait()
        return self.healthy

    async def weight_version(self) -> str:
        return self.version

    async def pause(self) -> None:
        self.paused = True

    async def resume(self) -> None:
        self.paused = False

    async def flush_cache(self) -> None:
        return None

    async def abort(self, rid: str | None = None) -> None:
        self.aborts.append(rid)
        if rid is None:
            self._abort_all += 1
        else:
            self._abort_rids.add(rid)

    async def update_weights_from_disk(self, model_path: str, weight_version: str) -> None:
        self.version = weight_version

    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str, backend: str) -> None:
        raise EngineError("the fake engine has no distributed weight updates")

    async def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                              group_name: str, weight_version: str, flush_cache: bool = True) -> None:
        raise EngineError("the fake engine has no distributed weight updates")

    async def destroy_weights_update_group(self, group_name: str) -> None:
        return None

    async def update_weights_from_tensor(self, serialized_named_tensors: list[str], load_format: str | None,
                                         weight_version: str, flush_cache: bool = True) -> None:
        if "weights" in self.released:
            raise EngineError(f"{self.url}: weights are released")
        self.log.append("update_weights")
        self.version = weight_version

    async def release_memory(self, tags: list[str]) -> None:
        if self.mode == "dead":
            raise EngineError(f"{self.url}: connection refused")
        self.log.append(f"release {','.join(tags)}")
        self.released |= set(tags)

    async def resume_memory(self, tags: list[str]) -> None:
        if self.mode == "dead":
            raise EngineError(f"{self.url}: connection refused")
        missing = set(tags) - self.released
        if missing:
            raise EngineError(f"{self.url}: {sorted(missing)} not released")
        self.log.append(f"resume {','.join(tags)}")
        self.released -= set(tags)

    async def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list[float]:
        return []

    async def update_weight_version(self, new_version: str, abort_all_requests: bool = False) -> None:
        self.version = new_version

    async def load_lora_adapter(self, lora_name: str, lora_path: str) -> dict[str, Any]:
        self.adapters[lora_name] = lora_path
        return {"success": True, "loaded_adapters": dict(self.adapters)}

    async def load_lora_adapter_from_tensors(self, lora_name: str, config: dict[str, Any],
                                             payloads: list[str]) -> dict[str, Any]:
        from miles_lite.formats.lora import read_adapter_payload

        self.adapters[lora_name] = "__tensor__"
        self.tensor_loads.append((lora_name, config, [read_adapter_payload(p) for p in payloads]))
        return {"success": True, "loaded_adapters": dict(self.adapters)}

    async def unload_lora_adapter(self, lora_name: str) -> dict[str, Any]:
        self.adapters.pop(lora_name)
        return {"success": True, "loaded_adapters": dict(self.adapters)}

    async def close(self) -> None:
        self.closed = True


class TensorTransport:
    """A weight transport that loads a version into each engine with `update_weights_from_tensor` (what a real
    transport does), carrying no tensors."""

    name = "fake"

    def __init__(self, loop: EngineLoop) -> None:
        self.loop = loop
        self.state = TransportState.NEW
        self.fleet: Sequence[FleetEngine] = ()

    def connect(self, fleet: Sequence[FleetEngine]) -> None:
        self.fleet, self.state = fleet, TransportState.CONNECTED

    def push(self, named_shards: object, version: str) -> PushReport:
        self.loop.gather({f.engine_id: self.loop.submit(f.engine.update_weights_from_tensor([], None, version))
                          for f in self.fleet})
        return PushReport(version, self.name, tuple(f.engine_id for f in self.fleet))

    def close(self) -> None:
        self.state = TransportState.CLOSED
