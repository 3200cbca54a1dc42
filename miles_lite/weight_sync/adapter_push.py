"""Adapter-only weight push for LoRA runs: only the adapter tensors move, never the frozen base.

Each push serves the trainer's adapters under a new name on every engine, as SGLang's LoRA serving API has
it, in one of two ways (`weight_sync.lora`):

- `adapter`: a PEFT directory `<root>/v<version>/` (written into a temporary directory, then renamed: an
  engine never reads half a version) that each engine loads (`/load_lora_adapter`); the engines must see
  `<root>` (same machine, or a shared file system). Older version directories are removed after a
  successful push.
- `tensors`: the adapter's tensors inside the request (`/load_lora_adapter_from_tensors`, with its
  `adapter_config.json`): nothing is written to disk, and engines on any machine can load it.

Then `/update_weight_version`, the engine's client switches its requests' `lora_path` to the new name, and the
adapter it served before is unloaded (`/unload_lora_adapter`). A request already running keeps the adapter it
started with (the engines resolve a name once, at submission).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from pathlib import Path

from miles_lite.config.lora_serving import ADAPTER_PUSHES
from miles_lite.formats.lora import LoraSpec, adapter_bytes, adapter_payload, save_adapter_dir
from miles_lite.weight_sync.disk import VERSION_DIR, version_dir
from miles_lite.weight_sync.transport import (
    EngineLoop,
    FleetEngine,
    PushReport,
    ShardSource,
    TransportState,
    WeightSyncError,
    WeightTransport,
    resolve_shards,
)


def adapter_name(version: str, attempt: int) -> str:
    """The name a pushed adapter is served under: new for every push, so a repeated push never collides."""
    return f"policy-v{version}-{attempt}"


class AdapterTransport(WeightTransport):
    """Pushes LoRA adapters that each engine loads by name (see the module docstring).

    Args:
        spec: the adapters' rank, alpha and targets (written into `adapter_config.json`).
        root: directory the versions are published under (`weight_sync.disk_dir`, default `<run>/adapters`).
        loop: the rollout event loop the engine calls run on.
        base_model: the base's HF directory, recorded in `adapter_config.json` (None for a generated model).
        via: `adapter` (a PEFT directory under `root`) or `tensors` (inside the request; `root` is not used).
    """

    def __init__(self, spec: LoraSpec, root: Path, loop: EngineLoop, base_model: str | None = None,
                 via: str = "adapter") -> None:
        super().__init__()
        if via not in ADAPTER_PUSHES:
            raise ValueError(f"weight_sync.lora={via!r}: adapters are pushed as {' or '.join(ADAPTER_PUSHES)}")
        self.spec = spec
        self.root = Path(root)
        self.loop = loop
        self.base_model = base_model
        self.via = via
        self.name = "lora_adapter" if via == "adapter" else "lora_tensors"
        self._attempts = 0
        self._published: str | None = None
        self._payload: tuple[str, str] | None = None  # (version, payload) of the last push from tensors

    def connect(self, fleet_engines: Sequence[FleetEngine]) -> None:
        self._require(TransportState.NEW, TransportState.CONNECTED, TransportState.FAILED)
        self._set_fleet(fleet_engines)
        self.state = TransportState.CONNECTED

    def _publish(self, version: str, tensors: dict) -> Path:
        final = version_dir(self.root, version)
        if self._published == version and final.is_dir():
            return final  # the same version again (to replacements, or after an engine died): same tensors
        tmp = self.root / f".tmp-v{version}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        save_adapter_dir(tmp, tensors, self.spec, self.base_model)
        # A directory of this version left by an earlier run (resumed from an older checkpoint) is replaced.
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
        self._published = version
        return final

    def push(self, named_shards: ShardSource, version: str) -> PushReport:
        """Hand `named_shards` (one entry: `{PEFT name: full tensor}`) to every engine and switch it to them."""
        self._require(TransportState.CONNECTED)
        report = PushReport(version, self.name, tuple(f.engine_id for f in self.fleet))
        try:
            shards = resolve_shards(named_shards, report)
            if len(shards) != 1 or not shards[0]:
                raise WeightSyncError("the adapter push needs the trainer's adapter tensors (one gathered entry); "
                                      f"got {len(shards)} entries")
            tensors = dict(shards[0])
            with report.phase("transfer"):
                source = self._publish(version, tensors) if self.via == "adapter" else self._serialize(version, tensors)
            report.bytes = adapter_bytes(tensors.values())
            report.buckets = 1
            self._attempts += 1
            name = adapter_name(version, self._attempts)
            with report.phase("load"):
                self._switch(name, source, version)
        except BaseException:
            self.state = TransportState.FAILED
            raise
        if self.via == "adapter":
            self._prune(version)
        return report

    def _serialize(self, version: str, tensors: dict) -> str:
        if self._payload is None or self._payload[0] != version:  # the same version again: the same tensors
            self._payload = (version, adapter_payload(tensors))
        return self._payload[1]

    def _switch(self, name: str, source: Path | str, version: str) -> None:
        loop = self.loop
        config = self.spec.peft_config(self.base_model)

        async def load(f: FleetEngine) -> None:
            if isinstance(source, Path):
                await f.engine.load_lora_adapter(name, str(source.resolve()))
            else:  # every engine TP rank gets the whole adapter and keeps its own slices
                await f.engine.load_lora_adapter_from_tensors(name, config, [source] * f.spec.tp)
            await f.engine.update_weight_version(version, abort_all_requests=False)

        loop.gather({f.engine_id: loop.submit(load(f)) for f in self.fleet})
        previous = {f.engine_id: getattr(f.engine, "lora_name", None) for f in self.fleet}
        for f in self.fleet:
            f.engine.lora_name = name  # type: ignore[attr-defined]
        loop.gather({f.engine_id: loop.submit(f.engine.unload_lora_adapter(old)) for f in self.fleet
                     if (old := previous[f.engine_id]) is not None and old != name})

    def _prune(self, version: str) -> None:
        keep = version_dir(self.root, version).name
        for entry in self.root.iterdir() if self.root.is_dir() else ():
            if entry.is_dir() and VERSION_DIR.match(entry.name) and entry.name != keep:
                shutil.rmtree(entry, ignore_errors=True)

    def close(self) -> None:
        self.state = TransportState.CLOSED
