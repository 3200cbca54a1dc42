"""Trainer TP ranks for weight-sync tests: one spawned process per rank, each a real `RankSender`
holding that rank's Megatron-layout tensors (what a trainer rank holds after a step)."""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from miles_lite.net.ports import LOCAL_HOST, free_port
from miles_lite.weight_sync.senders import RankSender
from miles_lite.weight_sync.shard_protocol import RankSchedule, SendStats

REPLY_TIMEOUT_S = 120.0


def _rank_main(conn: Any, tp_rank: int, tp: int) -> None:
    torch.set_num_threads(1)
    sender = RankSender(tp_rank, tp)
    shards: dict[str, torch.Tensor] = {}
    try:
        while True:
            try:
                op, args = conn.recv()
            except EOFError:
                return
            try:
                if op == "stop":
                    conn.send(("ok", None))
                    return
                if op == "load":
                    shards = args
                    result = None
                elif op == "send":
                    result = sender.send(shards, args)
                else:
                    result = getattr(sender, op)(*args)
                conn.send(("ok", result))
            except Exception as exc:  # reported to the test process
                conn.send(("error", f"trainer rank {tp_rank}: {exc!r}"))
    finally:
        sender.leave()


class ProcessSenders:
    """`ShardSenders` over `tp` processes; `load(shards)` hands rank r the tensors `shards[r]`."""

    def __init__(self, tp: int) -> None:
        ctx = mp.get_context("spawn")
        self.procs, self.conns = [], []
        for rank in range(tp):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_rank_main, args=(child, rank, tp), daemon=True)
            proc.start()
            child.close()
            self.procs.append(proc)
            self.conns.append(parent)

    def _all(self, calls: Sequence[tuple[str, Any]]) -> list[Any]:
        for conn, call in zip(self.conns, calls, strict=True):
            conn.send(call)
        out = []
        for conn in self.conns:
            assert conn.poll(REPLY_TIMEOUT_S), "a trainer rank process did not answer"
            status, payload = conn.recv()
            if status != "ok":
                raise RuntimeError(payload)
            out.append(payload)
        return out

    def load(self, shards: Sequence[Mapping[str, torch.Tensor]]) -> None:
        self._all([("load", dict(s)) for s in shards])

    def weight_group_endpoint(self) -> tuple[str, int]:
        # Every rank runs on this machine: rank 0's rendezvous is on loopback.
        return LOCAL_HOST, free_port(LOCAL_HOST)

    def join_weight_group(self, master_address: str, master_port: int, world_size: int, group_name: str,
                          backend: str, timeout_s: float, key: str | None = None) -> None:
        args = (master_address, master_port, world_size, group_name, backend, timeout_s, key)
        self._all([("join", args)] * len(self.conns))

    def send_weight_bucket(self, schedules: Sequence[RankSchedule]) -> list[SendStats]:
        return self._all([("send", s) for s in schedules])

    def leave_weight_group(self) -> None:
        self._all([("leave", ())] * len(self.conns))

    def close(self) -> None:
        for proc, conn in zip(self.procs, self.conns, strict=True):
            try:
                conn.send(("stop", None))
            except OSError:
                pass
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
