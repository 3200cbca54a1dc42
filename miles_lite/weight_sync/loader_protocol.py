"""Requests of the engine-side weight loader (`miles_lite.engines.sglang.weight_loader`), built and decoded here.

SGLang 0.5.10 calls a function listed in `--custom-weight-loader` when `/update_weights_from_tensor`
names it as `load_format`: inside every TP worker, as `fn(model, named_tensors)`, where
`named_tensors` is `MultiprocessingSerializer.deserialize(serialized_named_tensors[tp_rank])`
(ForkingPickler through an allow-list unpickler, `torch.*` allowed), each tensor moved to the
worker's device. So each TP rank gets its own request, carried in the *name* of one empty tensor:
an empty tensor pickles without shared memory or file descriptors (torch special-cases empty
storages), so the payload is plain bytes that travel over HTTP between hosts.

Requests (JSON in the name, after `REQUEST_PREFIX`):
- join: join the weight-update group `group` as group rank `rank` of `world_size` (rendezvous at
  `master_address:master_port`, `backend` gloo | nccl); `params` lists the SGLang parameters the
  pushes will write and their shapes on this rank, checked against the model before joining;
- receive: this rank's slices of one bucket. `shards` = (HF name, SGLang parameter, row offset of
  the HF tensor's local shard inside that parameter, dtype, local shard shape, expert: the index along
  the stacked parameter's first dimension for a routed expert, -1 otherwise); `blocks` = (source
  group rank, shard index, dim, start, length) in send order: every source sends one flat byte
  buffer holding its blocks in that order, each cast to its shard's dtype;
- leave: destroy the group.
The trainer side's send order comes from the same `bucket_blocks` walk, so both agree by construction.
"""

from __future__ import annotations

import base64
import io
import json
import pickle
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing  # noqa: F401  (registers the tensor reductions ForkingPickler uses)

from miles_lite.weight_sync.buckets import Bucket
from miles_lite.weight_sync.engine_layout import expert_index, sglang_param_name, store_shapes
from miles_lite.weight_sync.plan import DTYPE_BYTES, EngineSpec, ParamSpec, RankPlan, ShardPlan, Transfer, fused_offset

# The import path SGLang's `dynamic_import` resolves (module path, then the function name).
LOADER_FUNCTION = "miles_lite.engines.sglang.weight_loader.load_pushed_weights"
REQUEST_PREFIX = "miles_lite.weight_push:"
OPS = ("join", "receive", "leave")
BLOCK_COLUMNS = 5
SHARD_COLUMNS = 6


@dataclass(frozen=True)
class LoaderRequest:
    """One TP rank's request (see the module docstring); `fields` hold the op's arguments."""

    op: str
    group: str
    fields: dict[str, Any]

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"weight loader op {self.op!r} is not one of {OPS}")
        if not self.group:
            raise ValueError("weight loader request needs a group name")


def join_request(group: str, backend: str, master_address: str, master_port: int, rank: int, world_size: int,
                 timeout_s: float, params: dict[str, tuple[int, ...]]) -> LoaderRequest:
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend={backend!r}; the weight-update group uses 'nccl' (GPU) or 'gloo' (CPU)")
    if not 0 <= rank < world_size:
        raise ValueError(f"group rank {rank} is outside [0, {world_size})")
    return LoaderRequest("join", group, {
        "backend": backend, "master_address": master_address, "master_port": int(master_port), "rank": int(rank),
        "world_size": int(world_size), "timeout_s": float(timeout_s),
        "params": {name: [int(s) for s in shape] for name, shape in params.items()},
    })


def leave_request(group: str) -> LoaderRequest:
    return LoaderRequest("leave", group, {})


def bucket_blocks(bucket: Bucket, rank_plan: RankPlan) -> list[tuple[int, ShardPlan, Transfer]]:
    """(shard index within the bucket, shard, transfer) for one engine rank, in the order the bytes travel."""
    wanted = set(bucket.names)
    return [(index, shard, t) for index, shard in enumerate(s for s in rank_plan.shards if s.name in wanted)
            for t in shard.transfers]


def receive_request(group: str, bucket: Bucket, rank_plan: RankPlan, specs: dict[str, ParamSpec],
                    engine: EngineSpec, trainer_rank_offset: int = 0) -> LoaderRequest:
    """Engine rank `rank_plan.rank`'s part of `bucket`: its shards' places and the blocks each source sends.

    Trainer TP rank t is group rank `trainer_rank_offset + t`.
    """
    wanted = set(bucket.names)
    shards = []
    for shard in (s for s in rank_plan.shards if s.name in wanted):
        spec = specs[shard.name]
        shards.append([shard.name, sglang_param_name(shard.name), fused_offset(spec, engine.tp), shard.dtype,
                       list(shard.shape), expert_index(shard.name)])
    blocks = [[trainer_rank_offset + t.src_rank, index, t.dim, t.dst_start, t.length]
              for index, _, t in bucket_blocks(bucket, rank_plan)]
    return LoaderRequest("receive", group, {"shards": shards, "blocks": blocks})


def rank_params(specs: Sequence[ParamSpec], engine: EngineSpec, rank: int) -> dict[str, tuple[int, ...]]:
    """The SGLang parameters a push writes on engine rank `rank`, with their local shapes."""
    return store_shapes(specs, engine, rank)


# ---- encoding ---------------------------------------------------------------------------------------


def to_named_tensors(request: LoaderRequest) -> list[tuple[str, torch.Tensor]]:
    """The `named_tensors` the loader receives: one empty tensor whose name carries the request."""
    body = json.dumps({"op": request.op, "group": request.group, **request.fields}, separators=(",", ":"))
    return [(REQUEST_PREFIX + body, torch.empty(0, dtype=torch.uint8))]


def from_named_tensors(named_tensors: Sequence[tuple[str, Any]]) -> LoaderRequest:
    """Inverse of `to_named_tensors`; raises ValueError naming what is wrong with a foreign payload."""
    items = list(named_tensors)
    if len(items) != 1 or not isinstance(items[0][0], str) or not items[0][0].startswith(REQUEST_PREFIX):
        names = [str(n)[:60] for n, _ in items[:3]]
        raise ValueError(f"{LOADER_FUNCTION} takes one request tensor named {REQUEST_PREFIX!r}...; got "
                         f"{len(items)} tensors named e.g. {names} (HF-named tensors go with load_format=None)")
    data = json.loads(items[0][0][len(REQUEST_PREFIX):])
    op, group = data.pop("op", None), data.pop("group", None)
    request = LoaderRequest(str(op), str(group or ""), data)
    if request.op == "receive":
        _check_receive(request)
    return request


def _check_receive(request: LoaderRequest) -> None:
    shards, blocks = request.fields.get("shards"), request.fields.get("blocks")
    if not isinstance(shards, list) or not isinstance(blocks, list):
        raise ValueError("a receive request needs 'shards' and 'blocks' lists")
    for row in shards:
        if len(row) != SHARD_COLUMNS or row[3] not in DTYPE_BYTES:
            raise ValueError(f"receive request shard row {row!r} is not (hf name, parameter, offset, dtype, shape, "
                             "expert)")
    for row in blocks:
        if len(row) != BLOCK_COLUMNS or not 0 <= row[1] < len(shards):
            raise ValueError(f"receive request block row {row!r} is not (source, shard index, dim, start, length)")
        shape = shards[row[1]][4]
        if not 0 <= row[2] < len(shape) or row[3] < 0 or row[4] <= 0 or row[3] + row[4] > shape[row[2]]:
            raise ValueError(f"receive request block {row!r} does not fit shard {shards[row[1]][0]} of shape {shape}")


def serialize(request: LoaderRequest) -> str:
    """One entry of `serialized_named_tensors`: what SGLang's `MultiprocessingSerializer.deserialize` takes
    (base64 of a ForkingPickler dump); the reference engine decodes it with `deserialize`."""
    buf = io.BytesIO()
    ForkingPickler(buf).dump(to_named_tensors(request))
    return base64.b64encode(buf.getvalue()).decode("ascii")


class _AllowListUnpickler(pickle.Unpickler):
    """Loads only torch's tensor-rebuilding globals and builtins, as SGLang's SafeUnpickler allows."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "builtins" or module == "torch" or module.startswith("torch."):
            if (module, name) not in {("builtins", "eval"), ("builtins", "exec"), ("builtins", "compile")}:
                return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from serialized_named_tensors")


def deserialize(payload: str) -> list[tuple[str, torch.Tensor]]:
    """Inverse of `serialize` for engines without SGLang (the reference engine); an allow-list unpickler."""
    data = _AllowListUnpickler(io.BytesIO(base64.b64decode(payload, validate=True))).load()
    if not isinstance(data, list) or not all(isinstance(x, tuple) and len(x) == 2 for x in data):
        raise ValueError("serialized_named_tensors entry must decode to a list of (name, tensor) pairs")
    return data
