"""The processes of a benchmark's engine, looked at when it fails: each one's open descriptors and open-files
limits (from /proc), and their stacks (py-spy, one of SGLang's dependencies), for `rollout_throughput.py`."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from miles_lite.rollout.fleet import EngineFleet
from miles_lite.rollout.lifeline import group_members

# Seconds each py-spy dump may take.
DUMP_TIMEOUT_S = 20.0


def process_facts(pid: int) -> dict[str, Any]:
    """Process `pid`'s command name, state, open descriptors (and how many are sockets) and `Max open files`
    soft/hard limits, from /proc (None where it cannot be read: the process ended, or is not ours to read)."""
    facts: dict[str, Any] = {"pid": pid, "command": None, "state": None, "fds": None, "sockets": None,
                             "max_open_files": None}
    with contextlib.suppress(OSError):
        facts["command"] = Path(f"/proc/{pid}/comm").read_text().strip()
    with contextlib.suppress(OSError, IndexError):
        facts["state"] = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]  # R, S, Z (exited)...
    with contextlib.suppress(OSError):
        fds = os.listdir(f"/proc/{pid}/fd")
        facts["fds"] = len(fds)
        facts["sockets"] = sum(_is_socket(pid, fd) for fd in fds)
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
            if line.startswith("Max open files"):
                facts["max_open_files"] = line.split()[3:5]  # soft, hard: a number or "unlimited"
    return facts


def _is_socket(pid: int, fd: str) -> bool:
    try:
        return os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
    except OSError:  # closed meanwhile
        return False


def engine_pids(fleet: EngineFleet) -> list[int]:
    """The processes of the engine's process group (the launcher starts each engine in a session of its own:
    supervisor, server and the server's children)."""
    pid = fleet.records[0].handle.pid
    if pid is None:
        return []
    try:
        pgid = os.getpgid(pid)
    except OSError:  # the group's leader is gone; its group id was its pid
        pgid = pid
    return sorted(group_members(pgid))


def describe_processes(fleet: EngineFleet) -> list[dict[str, Any]]:
    """`process_facts` of every process of the engine's process group, then of this process."""
    described = [{"role": "engine", **process_facts(p)} for p in engine_pids(fleet)]
    return [*described, {"role": "benchmark", **process_facts(os.getpid())}]


def find_py_spy() -> str | None:
    """The py-spy program: on PATH, beside this Python, or in the bin/ of a directory on sys.path (where
    `pip install --target` puts it)."""
    if found := shutil.which("py-spy"):
        return found
    for d in [Path(sys.executable).parent, *(Path(p) / "bin" for p in sys.path if p)]:
        if os.access(d / "py-spy", os.X_OK):
            return str(d / "py-spy")
    return None


async def py_spy_dump(py_spy: str, pid: int, native: bool) -> str:
    """`py-spy dump` of `pid` (every thread's Python stack; `native`: with C/C++ frames), or why there is none."""
    proc = await asyncio.create_subprocess_exec(py_spy, "dump", "--pid", str(pid), *(["--native"] if native else []),
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), DUMP_TIMEOUT_S)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        return f"py-spy dump did not finish within {DUMP_TIMEOUT_S:.0f} s"
    text = out.decode(errors="replace")
    return text if proc.returncode == 0 else f"py-spy exited {proc.returncode}: {text}"


async def dump_stacks(pids: list[int], py_spy: str | None) -> list[dict[str, Any]]:
    """Each process's command and stacks: Python frames of all of them at once first (quick, before the fleet
    replaces the engine), then with native frames (slower: where a thread waits inside CUDA or NCCL)."""
    procs = [{"pid": p, "command": process_facts(p)["command"]} for p in pids]
    if py_spy is None:
        return [{**p, "stack": "py-spy not found (PATH, beside python, or bin/ of a sys.path entry)"} for p in procs]
    for key, native in (("stack", False), ("native_stack", True)):
        for p, text in zip(procs, await asyncio.gather(*(py_spy_dump(py_spy, p["pid"], native) for p in procs)),
                           strict=True):
            p[key] = text
    return procs


def print_processes(described: list[dict[str, Any]]) -> None:
    if not any(d["role"] == "engine" for d in described):
        print("    engine: no process left in its process group", flush=True)
    for d in described:
        limits = "/".join(d["max_open_files"]) if d["max_open_files"] else "?"
        print(f"    {d['role']:9s} pid {d['pid']} {d['command']} ({d['state']}): {d['fds']} open fds "
              f"({d['sockets']} sockets), max open files soft/hard {limits}", flush=True)
