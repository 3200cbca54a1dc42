"""The weight loader stock SGLang loads as a plugin: TP-aware pushes straight into each worker's parameters.

Started with `--custom-weight-loader miles_lite.engines.sglang.weight_loader.load_pushed_weights`;
SGLang 0.5.10 (`ModelRunner.update_weights_from_tensor`) then calls `load_pushed_weights(model,
named_tensors)` inside every TP worker's scheduler process when `/update_weights_from_tensor` is
posted with that `load_format`, rank r's `named_tensors` decoded from `serialized_named_tensors[r]`.
The reference engine calls the same function the same way in each of its TP ranks.

Each call carries one request (`weight_sync.loader_protocol`): join the weight-update group with the
trainer's TP ranks (once per fleet; the membership is kept on the model object between calls),
receive one bucket's blocks and copy each straight into its place inside the worker's own
(fused, TP-sharded) parameters, or leave. Nothing is gathered: every block travels from the
trainer rank that holds it to the engine rank that needs it. Buffers live on the parameters'
device for NCCL and in host memory for gloo (gloo's point-to-point ops are CPU-only).

SGLang discards the return value and answers success whatever happens short of an exception, and an
exception stops its scheduler; so every check that can be made runs at join (before the group
forms), and the probe log-probs after each push catch anything else.
"""

from __future__ import annotations

import enum
import logging
import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from miles_lite.net.api_key import key_from_env
from miles_lite.weight_sync.loader_protocol import LoaderRequest, from_named_tensors
from miles_lite.weight_sync.weight_group import init_custom_process_group

log = logging.getLogger(__name__)

# Attribute of the model object that holds the worker's receiver between calls.
RECEIVER_ATTR = "_miles_lite_weight_receiver"
LOADABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class ReceiverState(enum.Enum):
    IDLE = "idle"
    JOINED = "joined"


class WeightReceiver:
    """One TP worker's membership in the weight-update group: IDLE -> JOINED (join) -> IDLE (leave).

    A join while JOINED leaves the old group first (the fleet changed and the trainer built a new world).
    """

    def __init__(self) -> None:
        self.state = ReceiverState.IDLE
        self.group: dist.ProcessGroup | None = None
        self.group_name = ""
        self.backend = ""

    def join(self, params: dict[str, torch.Tensor], request: LoaderRequest) -> None:
        f = request.fields
        problems = _check_params(params, {name: tuple(shape) for name, shape in f["params"].items()})
        if problems:
            raise ValueError("the pushed weights do not fit this engine's parameters (trainer and engine must load "
                             "the same model; quantized engines take weight_sync.mode=full): " + "; ".join(problems))
        self.leave()
        # The engine's key (its environment names the file): the group admits only ranks of the same run.
        self.group = init_custom_process_group(f["backend"], f["master_address"], int(f["master_port"]),
                                               int(f["rank"]), int(f["world_size"]), request.group,
                                               float(f["timeout_s"]), key=key_from_env())
        self.group_name = request.group
        self.backend = f["backend"]
        self.state = ReceiverState.JOINED
        log.info("joined weight-update group %s at %s:%s as rank %s of %s (%s)", request.group, f["master_address"],
                 f["master_port"], f["rank"], f["world_size"], self.backend)

    def receive(self, params: dict[str, torch.Tensor], request: LoaderRequest) -> list[str]:
        """Receive one bucket's blocks into `params` in place; the HF names loaded."""
        if self.state is not ReceiverState.JOINED or self.group_name != request.group or self.group is None:
            raise RuntimeError(f"weight push for group {request.group!r}, but this worker is in "
                               f"{self.group_name or 'no group'!r}; the trainer joins it first (transport connect)")
        device = next(iter(params.values())).device if self.backend == "nccl" and params else torch.device("cpu")
        buffers = {src: torch.empty(nbytes, dtype=torch.uint8, device=device)
                   for src, nbytes in buffer_sizes(request).items()}
        # Ascending source ranks, as every sender posts its sends in ascending destination ranks: NCCL
        # creates each pair's communicator at its first message, and this order cannot wait in a cycle.
        handles = [dist.irecv(buffers[src], src=src, group=self.group) for src in sorted(buffers)]
        for handle in handles:
            handle.wait()
        return write_blocks(params, request, buffers)

    def leave(self) -> None:
        """Destroy the membership (idempotent)."""
        if self.group is not None:
            dist.destroy_process_group(self.group)
            log.info("left weight-update group %s", self.group_name)
        self.group = None
        self.group_name = ""
        self.state = ReceiverState.IDLE


# Per source group rank: (shard index, dim, start, length, bytes) of each block, in arrival order.
SourceBlocks = dict[int, list[tuple[int, int, int, int, int]]]


def source_blocks(request: LoaderRequest) -> SourceBlocks:
    """The blocks of a receive request grouped by the group rank that sends them, in send order."""
    shards = request.fields["shards"]
    per_src: SourceBlocks = {}
    for src, index, dim, start, length in request.fields["blocks"]:
        per_src.setdefault(int(src), []).append((index, dim, start, length, _block_bytes(shards[index], dim, length)))
    return per_src


def buffer_sizes(request: LoaderRequest) -> dict[int, int]:
    """Bytes each source sends for a receive request (one flat buffer per source)."""
    return {src: sum(row[-1] for row in rows) for src, rows in source_blocks(request).items()}


def write_blocks(params: dict[str, torch.Tensor], request: LoaderRequest, buffers: dict[int, torch.Tensor]
                 ) -> list[str]:
    """Copy every received block into its place inside `params` (in place); the HF names loaded.

    Called after the buffers arrived, also when a shard does not fit (the senders must not be left
    blocked): then nothing is written and ValueError names the shards.
    """
    shards = request.fields["shards"]
    regions, problems = _regions(params, shards)
    if problems:
        raise ValueError("; ".join(problems))
    for src, rows in source_blocks(request).items():
        offset = 0
        for index, dim, start, length, nbytes in rows:
            target = regions[index].narrow(dim, start, length)
            dtype = getattr(torch, shards[index][3])
            chunk = buffers[src][offset:offset + nbytes]
            if chunk.storage_offset() % dtype.itemsize:
                chunk = chunk.clone()  # a dtype view needs an aligned start
            target.copy_(chunk.view(dtype).view(target.shape))
            offset += nbytes
    return [row[0] for row in shards]


def _check_params(params: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...]]) -> list[str]:
    problems = []
    for name, shape in expected.items():
        param = params.get(name)
        if param is None:
            problems.append(f"no parameter {name!r} (the model has e.g. {sorted(params)[:3]})")
        elif tuple(param.shape) != shape:
            problems.append(f"{name}: shape {tuple(param.shape)} here, the push writes {shape}")
        elif param.dtype not in LOADABLE_DTYPES:
            problems.append(f"{name}: dtype {param.dtype} is not one of {LOADABLE_DTYPES}")
    return problems[:5] + ([f"... {len(problems) - 5} more"] if len(problems) > 5 else [])


def _regions(params: dict[str, torch.Tensor], shards: Sequence[Sequence[Any]]) -> tuple[list[torch.Tensor], list[str]]:
    """Per shard, the view of its parameter that holds it (rows `offset..offset+rows` on dim 0; a routed
    expert's within its expert of the stacked parameter)."""
    regions, problems = [], []
    for hf_name, target, offset, _dtype, shape, expert in shards:
        param = params.get(target)
        data = None if param is None else param.data
        if data is not None and expert >= 0:
            data = data[expert] if data.dim() == len(shape) + 1 and expert < data.shape[0] else None
        if data is None or data.dim() != len(shape) or tuple(data.shape[1:]) != tuple(shape[1:]) \
                or offset + shape[0] > data.shape[0]:
            where = f" of expert {expert}" if expert >= 0 else ""
            problems.append(f"{hf_name}: shard {tuple(shape)} at row {offset}{where} does not fit parameter "
                            f"{target!r} {tuple(param.shape) if param is not None else '(missing)'}")
            regions.append(torch.empty(0))
            continue
        regions.append(data.narrow(0, int(offset), int(shape[0])))
    return regions, problems


def _block_bytes(shard: Sequence[Any], dim: int, length: int) -> int:
    shape = shard[4]
    return math.prod(s for i, s in enumerate(shape) if i != dim) * length * getattr(torch, shard[3]).itemsize


def receiver_of(model: Any) -> WeightReceiver:
    """The receiver kept on `model` (created on first use)."""
    receiver = getattr(model, RECEIVER_ATTR, None)
    if receiver is None:
        receiver = WeightReceiver()
        setattr(model, RECEIVER_ATTR, receiver)
    return receiver


def load_pushed_weights(model: Any, named_tensors: Sequence[tuple[str, Any]]) -> list[str]:
    """SGLang's custom weight loader entry point: run the request carried by `named_tensors` on `model`.

    `model` is anything with `named_parameters()` in SGLang's layout (SGLang's model; the reference
    engine's per-rank parameter store). Returns the HF names loaded (empty for join / leave).
    """
    request = from_named_tensors(named_tensors)
    receiver = receiver_of(model)
    if request.op == "leave":
        if receiver.group_name in ("", request.group):
            receiver.leave()
        return []
    params = dict(model.named_parameters())
    if request.op == "join":
        receiver.join(params, request)
        return []
    with torch.no_grad():
        return receiver.receive(params, request)
