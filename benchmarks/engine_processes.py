"""The processes of a benchmark's engine, looked at when it fails (`miles_lite.engines.process_stacks`: open
descriptors and open-files limits from /proc, stacks from py-spy), for `rollout_throughput.py`."""

from __future__ import annotations

import os
from typing import Any

from miles_lite.engines.process_stacks import dump_stacks, find_py_spy, group_pids, process_facts
from miles_lite.rollout.fleet import EngineFleet

__all__ = ["describe_processes", "dump_stacks", "engine_pids", "find_py_spy", "print_processes"]


def engine_pids(fleet: EngineFleet) -> list[int]:
    """The processes of the engine's process group (supervisor, server and the server's children)."""
    pid = fleet.records[0].handle.pid
    return [] if pid is None else group_pids(pid)


def describe_processes(fleet: EngineFleet) -> list[dict[str, Any]]:
    """`process_facts` of every process of the engine's process group, then of this process."""
    described = [{"role": "engine", **process_facts(p)} for p in engine_pids(fleet)]
    return [*described, {"role": "benchmark", **process_facts(os.getpid())}]


def print_processes(described: list[dict[str, Any]]) -> None:
    if not any(d["role"] == "engine" for d in described):
        print("    engine: no process left in its process group", flush=True)
    for d in described:
        limits = "/".join(d["max_open_files"]) if d["max_open_files"] else "?"
        print(f"    {d['role']:9s} pid {d['pid']} {d['command']} ({d['state']}): {d['fds']} open fds "
              f"({d['sockets']} sockets), max open files soft/hard {limits}", flush=True)
