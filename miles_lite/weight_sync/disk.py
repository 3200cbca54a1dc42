"""Disk transport: full HF safetensors in a shared directory, then `update_weights_from_disk` per engine.

Layout: `<root>/v<version>/model-00001-of-0000N.safetensors` (+ `model.safetensors.index.json`, and
the non-weight files of `template_dir`, e.g. config.json). A version is written into
`<root>/.tmp-v<version>-<pid>/`, every file and the directory are fsynced, then one `os.rename`
publishes it: an engine (or a crash) never sees a half-written version. The newest `keep_versions`
complete versions are kept; older ones are removed after a successful push.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file

from miles_lite.weight_sync.buckets import full_buckets
from miles_lite.weight_sync.plan import ParamSpec, apply_rank_plan, full_tensor_plan, sender_count
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

VERSION_DIR = re.compile(r"^v(.+)$")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".safetensors.index.json")


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def version_dir(root: Path, version: str) -> Path:
    """`<root>/v<version>`; the version must be usable as a file name."""
    if not version or "/" in version or version.startswith("."):
        raise ValueError(f"weight version {version!r} cannot name a directory; use e.g. the step number")
    return root / f"v{version}"


def write_version(root: Path, version: str, tensors: Mapping[str, torch.Tensor], bucket_names: Sequence[Sequence[str]],
                  template_dir: Path | None = None) -> Path:
    """Atomically publish `tensors` as `<root>/v<version>/` in one safetensors file per bucket.

    Returns the published directory. Raises FileExistsError if that version already exists.
    """
    root.mkdir(parents=True, exist_ok=True)
    final = version_dir(root, version)
    if final.exists():
        raise FileExistsError(f"{final} already exists; weight versions are written once")
    tmp = root / f".tmp-v{version}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        if template_dir is not None:
            for item in sorted(Path(template_dir).iterdir()):
                if item.is_file() and not item.name.endswith(WEIGHT_SUFFIXES):
                    shutil.copy2(item, tmp / item.name)
        total = len(bucket_names)
        weight_map: dict[str, str] = {}
        for i, names in enumerate(bucket_names):
            fname = f"model-{i + 1:05d}-of-{total:05d}.safetensors"
            save_file({n: tensors[n].contiguous() for n in names}, str(tmp / fname), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(names, fname))
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        (tmp / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": size, "weight_version": version}, "weight_map": weight_map},
                       indent=1))
        for item in tmp.iterdir():
            _fsync(item)
        _fsync(tmp)
        os.rename(tmp, final)
        _fsync(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def complete_versions(root: Path) -> list[Path]:
    """Published version directories, oldest first (by modification time, then name)."""
    if not root.exists():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and VERSION_DIR.match(p.name)]
    return sorted(found, key=lambda p: (p.stat().st_mtime_ns, p.name))


def prune_versions(root: Path, keep: int, protect: Path | None = None) -> list[Path]:
    """Remove all but the newest `keep` versions (never `protect`) and stale temp dirs; returns what was removed."""
    if keep < 1:
        raise ValueError(f"keep_versions={keep} must be >= 1 (the version engines serve must stay on disk)")
    removed = []
    versions = complete_versions(root)
    for path in versions[: max(len(versions) - keep, 0)]:
        if protect is not None and path == protect:
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    for tmp in root.glob(".tmp-v*"):
        if not tmp.name.endswith(f"-{os.getpid()}"):
            continue
        shutil.rmtree(tmp, ignore_errors=True)
        removed.append(tmp)
    return removed


class DiskTransport(WeightTransport):
    """safetensors on a shared directory; each engine loads the published version from disk."""

    name = "disk"

    def __init__(self, specs: Sequence[ParamSpec], trainer_tp: int, root: str | Path, loop: EngineLoop, *,
                 bucket_bytes: int, keep_versions: int = 2, template_dir: str | Path | None = None) -> None:
        super().__init__()
        if not root:
            raise ValueError("weight_sync.disk_dir is unset; the disk transport needs a directory all engines read")
        self.root = Path(root)
        self.loop = loop
        self.keep_versions = keep_versions
        self.template_dir = Path(template_dir) if template_dir else None
        self.plan = full_tensor_plan(specs, trainer_tp)
        self.buckets = full_buckets(self.plan, bucket_bytes)
        self.trainer_tp = trainer_tp
        self.num_senders = sender_count(specs, trainer_tp)
        # (version, bytes) of the last version this transport wrote.
        self._published: tuple[str, int] | None = None

    def connect(self, fleet_engines: Sequence[FleetEngine]) -> None:
        """Nothing to open: remember the fleet (engines only need to see `root`)."""
        self._require(TransportState.NEW, TransportState.CONNECTED, TransportState.FAILED)
        self._set_fleet(fleet_engines)
        self.state = TransportState.CONNECTED

    def push(self, named_shards: ShardSource, version: str) -> PushReport:
        """Write `v<version>/` atomically, then load it on every engine concurrently.

        Pushing the version this transport published last again (a push repeated without an engine that
        died during it; the trainer has not stepped since) loads the files already written, without
        gathering or converting the shards again.
        """
        self._require(TransportState.CONNECTED)
        version = str(version)
        report = PushReport(version, self.name, tuple(f.engine_id for f in self.fleet))
        if self._published is not None and self._published[0] == version:
            path, report.bytes = version_dir(self.root, version), self._published[1]
        else:
            shards = resolve_shards(named_shards, report, self.num_senders)
            with report.phase("convert"):
                tensors = apply_rank_plan(self.plan, shards)
            with report.phase("transfer"):
                path = write_version(self.root, version, tensors, [b.names for b in self.buckets], self.template_dir)
            report.bytes = sum(t.numel() * t.element_size() for t in tensors.values())
            self._published = (version, report.bytes)
        report.buckets = len(self.buckets)
        with report.phase("load"):
            futures = {f.engine_id: self.loop.submit(f.engine.update_weights_from_disk(str(path), version))
                       for f in self.fleet}
            try:
                self.loop.gather(futures)
            except WeightSyncError:
                self.state = TransportState.FAILED
                raise
        prune_versions(self.root, self.keep_versions, protect=path)
        return report

    def close(self) -> None:
        self.state = TransportState.CLOSED
