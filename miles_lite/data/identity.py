"""What a run's prompt cursor indexes: the identity of its training data, recorded in every checkpoint.

A checkpoint's cursor is a position in a list of problems; it means something only on the same list.
Each `data.source` supplies its identity through one function of `IDENTITY_BY_SOURCE`:

- files (`gsm8k`): the training file's path, size and sha256 (the content, wherever the file now lives);
- `records`: the same of each of its files (a folder's data files, a glob's matches, a list's entries, in
  order), plus the key mapping (another mapping can yield other prompts);
- `synthetic`: the generator's spec, the number of problems and the seed.

An identity is a JSON-able dict: `source`, `what` (a line naming the data for messages) and `key` (what
must be equal for a cursor to carry over). Two identities name the same data when `source` and `key` agree.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from miles_lite.config.schema import DataConfig
from miles_lite.data.record_files import data_files, record_paths
from miles_lite.data.records import RecordKeys

_CHUNK = 1 << 20


def file_sha256(path: str | Path) -> str:
    """sha256 of a file's bytes, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def file_identity(path: str | Path, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """A data file by content: its resolved path (named in messages), size and sha256 (compared).
    `extra`: what else decides which problems the file yields (e.g. a records source's key mapping)."""
    resolved = Path(path).resolve()
    size = resolved.stat().st_size
    sha = file_sha256(resolved)
    key: dict[str, Any] = {"bytes": size, "sha256": sha, **(extra or {})}
    return {"what": f"file {resolved} ({size} bytes, sha256 {sha[:12]}...)", "path": str(resolved), "key": key}


def _gsm8k(data: DataConfig) -> dict[str, Any]:
    return file_identity(str(data.train_path))


def records_identity(spec: Any, keys: RecordKeys) -> dict[str, Any]:
    """Records by content (every file `spec` names, in reading order) and the key mapping that reads them (named
    in `what`, so that a message about a changed mapping shows which key changed). One file keeps the identity
    of a single file, so checkpoints of earlier runs still match."""
    files = [f for path in record_paths(spec) for f in data_files(path)]
    mapping = ", ".join(f"data.{name}={value}" for name, value in keys.as_dict().items() if value is not None)
    if len(files) == 1:
        identity = file_identity(files[0], extra={"keys": keys.as_dict()})
        return {**identity, "what": f"{identity['what']} read with {mapping}"}
    each = [file_identity(f) for f in files]
    size = sum(e["key"]["bytes"] for e in each)
    return {"what": f"{len(files)} files from {files[0].parent} ({size} bytes; first {files[0].name}) read with "
                    f"{mapping}",
            "path": [e["path"] for e in each], "key": {"files": [e["key"] for e in each], "keys": keys.as_dict()}}


def _records(data: DataConfig) -> dict[str, Any]:
    return records_identity(data.train_path, RecordKeys.from_config(data))


def _synthetic(data: DataConfig) -> dict[str, Any]:
    syn = data.synthetic
    spec = {"train_size": syn.train_size, "min_steps": syn.min_steps, "max_steps": syn.max_steps,
            "min_operand": syn.min_operand, "max_operand": syn.max_operand, "ops": list(syn.ops),
            "max_result": syn.max_result, "seed": syn.seed}
    shown = ", ".join(f"{k}={v}" for k, v in spec.items())
    return {"what": f"synthetic problems ({shown})", "key": spec}


# data.source -> its identity; a new source adds one entry.
IDENTITY_BY_SOURCE: dict[str, Callable[[DataConfig], dict[str, Any]]] = {
    "gsm8k": _gsm8k,
    "records": _records,
    "synthetic": _synthetic,
}


def data_identity(data: DataConfig) -> dict[str, Any]:
    """The identity of the training data `data` (the `data` config group) names."""
    try:
        identify = IDENTITY_BY_SOURCE[data.source]
    except KeyError:
        raise ValueError(f"data.source={data.source!r} has no data identity; known sources: "
                         f"{', '.join(IDENTITY_BY_SOURCE)}") from None
    return {"source": data.source, **identify(data)}


def same_data(recorded: dict[str, Any], current: dict[str, Any]) -> bool:
    """Whether a cursor recorded on `recorded` data indexes the same problems on `current` data."""
    return recorded.get("source") == current.get("source") and recorded.get("key") == current.get("key")
