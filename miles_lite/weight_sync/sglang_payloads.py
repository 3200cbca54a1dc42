"""Request bodies of SGLang's weight-update HTTP endpoints, built as plain dicts.

Field names follow SGLang's `srt/managers/io_struct.py`, 0.5.10, 0.5.17 and 0.5.23 alike: every body sent here
is valid on each. The request structs are built with `Cls(**json)`, so an unknown key is a 400 and a missing
required key too. Only fields the caller sets explicitly, or that SGLang requires, are sent;
SGLang's defaults cover the rest.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

# Load formats of `update_weights_from_distributed`: None = one broadcast per tensor through the
# model's HF loader; "flattened_bucket" = one broadcast of the bucket's bytes (SGLang's own).
FLATTENED_BUCKET = "flattened_bucket"
PAUSE_MODES = ("abort", "retract", "in_place")
WEIGHTS_CHECKER_ACTIONS = ("snapshot", "reset_tensors", "compare")


@dataclass(frozen=True)
class SGLangRequest:
    """One HTTP call: method, path on the server, JSON body (None: no body)."""

    method: str
    path: str
    body: dict[str, Any] | None


def dtype_name(dtype: torch.dtype | str) -> str:
    """SGLang's dtype string (`getattr(torch, name)` must give the dtype back): torch.bfloat16 -> 'bfloat16'."""
    name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    if not isinstance(getattr(torch, name, None), torch.dtype):
        raise ValueError(f"dtype {dtype!r} is not a torch dtype name; use e.g. 'bfloat16' or 'float32'")
    return name


def _version(body: dict[str, Any], weight_version: str | None) -> dict[str, Any]:
    if weight_version is not None:
        body["weight_version"] = str(weight_version)
    return body


def init_weights_update_group(master_address: str, master_port: int, rank_offset: int, world_size: int,
                              group_name: str, backend: str) -> SGLangRequest:
    """`InitWeightsUpdateGroupReqInput`: the engine's TP rank i joins as group rank `rank_offset + i`."""
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"backend={backend!r}; the weight-update group uses 'nccl' (GPU) or 'gloo' (CPU)")
    if not 0 < rank_offset < world_size:
        raise ValueError(f"rank_offset={rank_offset} must be in 1..{world_size - 1} (rank 0 is the trainer)")
    if not 0 < master_port < 65536:
        raise ValueError(f"master_port={master_port} is not a TCP port")
    return SGLangRequest("POST", "/init_weights_update_group", {
        "master_address": master_address, "master_port": int(master_port), "rank_offset": int(rank_offset),
        "world_size": int(world_size), "group_name": group_name, "backend": backend,
    })


def destroy_weights_update_group(group_name: str) -> SGLangRequest:
    """`DestroyWeightsUpdateGroupReqInput`."""
    return SGLangRequest("POST", "/destroy_weights_update_group", {"group_name": group_name})


def update_weights_from_distributed(names: Sequence[str], dtypes: Sequence[torch.dtype | str],
                                    shapes: Sequence[Sequence[int]], group_name: str, *,
                                    weight_version: str | None = None, flush_cache: bool = True,
                                    load_format: str | None = None) -> SGLangRequest:
    """`UpdateWeightsFromDistributedReqInput`: receive `names` (shapes in elements) over the group."""
    if not (len(names) == len(dtypes) == len(shapes)) or not names:
        raise ValueError(f"names/dtypes/shapes must be equally long and non-empty; got "
                         f"{len(names)}/{len(dtypes)}/{len(shapes)}")
    if load_format not in (None, FLATTENED_BUCKET):
        raise ValueError(f"load_format={load_format!r}; use None or {FLATTENED_BUCKET!r}")
    body: dict[str, Any] = {
        "names": list(names), "dtypes": [dtype_name(d) for d in dtypes],
        "shapes": [[int(s) for s in shape] for shape in shapes], "group_name": group_name,
        "flush_cache": bool(flush_cache),
    }
    if load_format is not None:
        body["load_format"] = load_format
    return SGLangRequest("POST", "/update_weights_from_distributed", _version(body, weight_version))


def update_weights_from_tensor(serialized_per_tp_rank: Sequence[str], *, load_format: str | None = None,
                               weight_version: str | None = None, flush_cache: bool = True) -> SGLangRequest:
    """`UpdateWeightsFromTensorReqInput`: entry i is what TP rank i deserialises (base64 strings)."""
    if not serialized_per_tp_rank or not all(isinstance(s, str) for s in serialized_per_tp_rank):
        raise ValueError("serialized_named_tensors must hold one base64 string per engine TP rank")
    body: dict[str, Any] = {"serialized_named_tensors": list(serialized_per_tp_rank), "flush_cache": bool(flush_cache)}
    if load_format is not None:
        body["load_format"] = load_format
    return SGLangRequest("POST", "/update_weights_from_tensor", _version(body, weight_version))


def update_weights_from_disk(model_path: str, *, weight_version: str | None = None, flush_cache: bool = True,
                             load_format: str | None = None) -> SGLangRequest:
    """`UpdateWeightFromDiskReqInput`: reload HF safetensors from `model_path` (a directory the engine can read)."""
    if not model_path:
        raise ValueError("model_path is empty; pass the versioned checkpoint directory")
    body: dict[str, Any] = {"model_path": str(model_path), "flush_cache": bool(flush_cache)}
    if load_format is not None:
        body["load_format"] = load_format
    return SGLangRequest("POST", "/update_weights_from_disk", _version(body, weight_version))


def update_weight_version(new_version: str, *, abort_all_requests: bool = False) -> SGLangRequest:
    """`UpdateWeightVersionReqInput` (SGLang's default aborts running requests; callers pause first instead)."""
    return SGLangRequest("POST", "/update_weight_version",
                         {"new_version": str(new_version), "abort_all_requests": bool(abort_all_requests)})


def get_weights_by_name(name: str, truncate_size: int = 100) -> SGLangRequest:
    """`GetWeightsByNameReqInput`: the first `truncate_size` rows of a parameter, as nested lists."""
    if truncate_size <= 0:
        raise ValueError(f"truncate_size={truncate_size} must be > 0")
    return SGLangRequest("POST", "/get_weights_by_name", {"name": name, "truncate_size": int(truncate_size)})


def pause_generation(mode: str = "retract") -> SGLangRequest:
    """`PauseGenerationReqInput`: 'retract' keeps requests (recomputed after continue) and lets the cache flush."""
    if mode not in PAUSE_MODES:
        raise ValueError(f"pause mode={mode!r}; use one of {PAUSE_MODES}")
    return SGLangRequest("POST", "/pause_generation", {"mode": mode})


def continue_generation() -> SGLangRequest:
    """`ContinueGenerationReqInput` (no fields)."""
    return SGLangRequest("POST", "/continue_generation", {})


def flush_cache() -> SGLangRequest:
    """`/flush_cache` (no body)."""
    return SGLangRequest("POST", "/flush_cache", None)


def weights_checker(action: str) -> SGLangRequest:
    """`CheckWeightsReqInput`: snapshot | reset_tensors | compare."""
    if action not in WEIGHTS_CHECKER_ACTIONS:
        raise ValueError(f"weights_checker action={action!r}; use one of {WEIGHTS_CHECKER_ACTIONS}")
    return SGLangRequest("POST", "/weights_checker", {"action": action})


def model_info() -> SGLangRequest:
    """`/model_info`, whose answer holds `weight_version`."""
    return SGLangRequest("GET", "/model_info", None)
