"""The reference engine's TP ranks in the weight-update group: rank 0 in the server process, ranks 1..tp-1
in worker subprocesses, as SGLang's TP workers are (gloo allows one rank of a group per process).

SGLang's own weight-update group (`/init_weights_update_group`, full HF tensors broadcast from rank 0):
every rank joins as `rank_offset + r`, takes part in every broadcast and hands back only its local
shards, HF-named, which the server places into that rank's store. The weight-loader plugin
(`/update_weights_from_tensor` with a `load_format` listed in `--custom-weight-loader`): every rank
calls the plugin function as an SGLang TP worker does, `fn(rank_parameters, named_tensors)`, on its own
store (shared memory with the server process), and hands back the HF names it loaded. Workers answer
over a pipe: a status message, then (for a receive) the shards' metadata and their bytes in one buffer.

Worker lifecycle: STARTING (spawned) -> READY (answered the first ping) -> STOPPED (`close`, or the
server process went away: the pipe closes and the worker exits).
"""

from __future__ import annotations

import enum
import importlib
import math
import multiprocessing as mp
import traceback
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

import torch

from miles_lite.engines.reference.shards import RankParameters
from miles_lite.engines.sglang.weight_loader import receiver_of
from miles_lite.net.api_key import key_from_env
from miles_lite.weight_sync.engine_layout import Store, shard_full
from miles_lite.weight_sync.loader_protocol import deserialize
from miles_lite.weight_sync.plan import EngineSpec, ParamSpec
from miles_lite.weight_sync.weight_group import broadcast_receive, init_custom_process_group

Shards = list[tuple[str, torch.Tensor]]


class RankGroups:
    """One rank's weight-update groups and the receive operations on them (runs in any process)."""

    def __init__(self, rank: int, specs: Sequence[ParamSpec], engine: EngineSpec) -> None:
        self.rank = rank
        self.specs = {s.name: s for s in specs}
        self.engine = engine
        self.groups: dict[str, Any] = {}

    def join(self, name: str, backend: str, address: str, port: int, rank_offset: int, world: int,
             timeout_s: float) -> None:
        if name in self.groups:
            raise ValueError(f"group {name!r} already exists; destroy it first")
        # The engine's key (its environment names the file): the group admits only ranks of the same run.
        self.groups[name] = init_custom_process_group(backend, address, port, rank_offset + self.rank, world, name,
                                                      timeout_s, key=key_from_env())

    def receive(self, name: str, names: list[str], dtypes: list[str], shapes: list[list[int]]) -> Shards:
        """This rank's local shards of `names`, sliced from the full tensors rank 0 broadcasts."""
        if name not in self.groups:
            raise ValueError(f"Group {name} not in {sorted(self.groups)}. Call init_weights_update_group first.")
        unknown = [n for n in names if n not in self.specs]
        if unknown:
            raise ValueError(f"unknown parameter names {unknown[:5]} (the model has e.g. {list(self.specs)[:3]})")
        full = broadcast_receive(self.groups[name], names, dtypes, shapes)
        # SGLang's loaders narrow every broadcast full tensor to the rank's own slice.
        return [(n, shard_full(self.specs[n], t, self.engine, self.rank)) for n, t in full]

    def destroy(self, name: str) -> bool:
        import torch.distributed as dist

        group = self.groups.pop(name, None)
        if group is not None:
            dist.destroy_process_group(group)
        return group is not None

    def close(self) -> None:
        for name in list(self.groups):
            self.destroy(name)


def run_custom_loader(function: str, params: RankParameters, payload: str) -> list[str]:
    """Call plugin `function` (a `module.function` path, imported as SGLang's `dynamic_import` does) on one
    rank's parameters with that rank's decoded `named_tensors`; the HF names it reports loaded."""
    module, _, attr = function.rpartition(".")
    if not module:
        raise ValueError(f"custom weight loader {function!r} must be a module.function path")
    loaded = getattr(importlib.import_module(module), attr)(params, deserialize(payload))
    return [str(n) for n in loaded or []]


def _send_shards(conn: Connection, shards: Shards) -> None:
    meta = [(n, str(t.dtype).removeprefix("torch."), list(t.shape)) for n, t in shards]
    conn.send(("ok", meta))
    parts = [t.contiguous().reshape(-1).view(torch.uint8) for _, t in shards]
    conn.send_bytes(torch.cat(parts).numpy().tobytes() if parts else b"")


def _recv_shards(conn: Connection, meta: list[tuple[str, str, list[int]]]) -> Shards:
    data = conn.recv_bytes()
    flat = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    out, offset = [], 0
    for name, dtype_name, shape in meta:
        dtype = getattr(torch, dtype_name)
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        out.append((name, flat[offset:offset + nbytes].clone().view(dtype).reshape(shape)))
        offset += nbytes
    return out


def _worker_main(conn: Connection, rank: int, specs: list[ParamSpec], engine: EngineSpec, store: Store) -> None:
    """Body of the worker process of engine rank `rank` (>= 1): serve commands until `stop` or EOF."""
    torch.set_num_threads(1)
    groups = RankGroups(rank, specs, engine)
    params = RankParameters(store)
    try:
        while True:
            try:
                op, args = conn.recv()
            except EOFError:  # the server process is gone
                return
            if op == "stop":
                conn.send(("ok", None))
                return
            try:
                if op == "receive":
                    _send_shards(conn, groups.receive(*args))
                    continue
                result = run_custom_loader(args[0], params, args[1]) if op == "custom_load" else \
                    getattr(groups, op)(*args)
                conn.send(("ok", result))
            except Exception as exc:  # reported to the server, which answers the HTTP call with it
                conn.send(("error", f"engine rank {rank}: {exc!r}\n{traceback.format_exc(limit=3)}"))
    finally:
        groups.close()
        receiver_of(params).leave()


class WorkerState(enum.Enum):
    STARTING = "starting"
    READY = "ready"
    STOPPED = "stopped"


class EngineRanks:
    """All TP ranks of one reference engine, driven together from the server process."""

    def __init__(self, specs: Sequence[ParamSpec], engine: EngineSpec, reply_timeout_s: float,
                 stores: Sequence[Store]) -> None:
        if len(stores) != engine.tp:
            raise ValueError(f"got {len(stores)} rank stores for an engine with tp={engine.tp}")
        self.engine = engine
        self.reply_timeout_s = reply_timeout_s
        self.local = RankGroups(0, specs, engine)
        self.local_params = RankParameters(stores[0])
        for store in stores[1:]:
            for tensor in store.values():
                tensor.share_memory_()  # the worker writes its rank's store in place, the server reads it
        ctx = mp.get_context("spawn")
        self.workers: list[tuple[Any, Connection]] = []
        self.state = WorkerState.STARTING
        for rank in range(1, engine.tp):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker_main, args=(child, rank, list(specs), engine, stores[rank]),
                               name=f"reference-rank-{rank}", daemon=True)
            proc.start()
            child.close()
            self.workers.append((proc, parent))
        self._all("destroy", ("__ping__",), lambda: None)  # every worker imported torch and answers
        self.state = WorkerState.READY

    def _reply(self, rank: int, conn: Connection) -> tuple[str, Any]:
        if not conn.poll(self.reply_timeout_s):
            raise RuntimeError(f"engine rank {rank} did not answer within {self.reply_timeout_s:.0f} s")
        try:
            return conn.recv()
        except EOFError as exc:
            raise RuntimeError(f"engine rank {rank}'s worker process exited") from exc

    def _all(self, op: str, args: tuple | Sequence[tuple], local: Any, per_rank: bool = False) -> list[Any]:
        """Run `op(*args)` on every worker while `local()` runs rank 0's part here; results in rank order.

        `per_rank`: `args[r]` are worker r's arguments (index 0, rank 0's, is unused)."""
        for rank, (_, conn) in enumerate(self.workers, start=1):
            conn.send((op, args[rank] if per_rank else args))
        errors, results = [], []
        try:
            results.append(local())
        except Exception as exc:  # collected with the workers' answers so that no reply is left unread
            errors.append(f"engine rank 0: {exc!r}")
        for rank, (_, conn) in enumerate(self.workers, start=1):
            status, payload = self._reply(rank, conn)
            if status != "ok":
                errors.append(str(payload))
            elif op == "receive":
                results.append(_recv_shards(conn, payload))
            else:
                results.append(payload)
        if errors:
            raise RuntimeError("; ".join(errors))
        return results

    def join(self, name: str, backend: str, address: str, port: int, rank_offset: int, world: int,
             timeout_s: float) -> None:
        """Every rank joins group `name` as `rank_offset + rank`; blocks until the whole world has joined."""
        args = (name, backend, address, port, rank_offset, world, timeout_s)
        self._all("join", args, lambda: self.local.join(*args))

    def receive(self, name: str, names: list[str], dtypes: list[str], shapes: list[list[int]]) -> list[Shards]:
        """Per rank, its HF-named local shards of `names` (see `RankGroups.receive`)."""
        args = (name, names, dtypes, shapes)
        return self._all("receive", args, lambda: self.local.receive(*args))

    def custom_load(self, function: str, payloads: Sequence[str]) -> list[list[str]]:
        """Rank r runs plugin `function` on its store with `payloads[r]`; per rank, the HF names loaded."""
        if len(payloads) != self.engine.tp:
            raise ValueError(f"got {len(payloads)} payloads for an engine with tp={self.engine.tp}")
        args = [(function, p) for p in payloads]
        return self._all("custom_load", args, lambda: run_custom_loader(function, self.local_params, payloads[0]),
                         per_rank=True)

    def destroy(self, name: str) -> bool:
        """Every rank leaves group `name`; False when it did not exist."""
        return all(self._all("destroy", (name,), lambda: self.local.destroy(name)))

    def close(self) -> None:
        """Leave every group and stop the workers (idempotent)."""
        if self.state is WorkerState.STOPPED:
            return
        self.state = WorkerState.STOPPED
        self.local.close()
        receiver_of(self.local_params).leave()
        for proc, conn in self.workers:
            try:
                conn.send(("stop", ()))
            except (BrokenPipeError, OSError):
                pass
            proc.join(timeout=10.0)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5.0)
            conn.close()
        self.workers = []
