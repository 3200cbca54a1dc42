"""What an engine server's processes are doing, for when it stops answering: each process's command, state, open
descriptors and open-files limits (from /proc), and its threads' stacks (py-spy, one of SGLang's dependencies),
Python frames first, then with native ones (where a thread waits inside CUDA or NCCL).

The fleet asks for this before it stops an engine it declared dead (`EngineHandle.diagnose`, set by
`engines.fleet_launch.fleet_launcher` and, under Ray, `cluster.engine_gang`): the report goes beside the engine's
log (`stacks_path`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

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


def group_pids(pid: int) -> list[int]:
    """The processes of `pid`'s process group (an engine's launcher starts it in a session of its own:
    supervisor, server and the server's children); its group id is its pid once it is gone."""
    try:
        pgid = os.getpgid(pid)
    except OSError:
        pgid = pid
    return sorted(group_members(pgid))


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
    """Each process's command and stacks: Python frames of all of them at once first (quick, while the state
    lasts), then with native frames (slower)."""
    procs = [{"pid": p, "command": process_facts(p)["command"]} for p in pids]
    if py_spy is None:
        return [{**p, "stack": "py-spy not found (PATH, beside python, or bin/ of a sys.path entry)"} for p in procs]
    for key, native in (("stack", False), ("native_stack", True)):
        for p, text in zip(procs, await asyncio.gather(*(py_spy_dump(py_spy, p["pid"], native) for p in procs)),
                           strict=True):
            p[key] = text
    return procs


def stacks_path(log_path: str | Path) -> Path:
    """Where the stacks of the engine logging to `log_path` go: beside it, `<engine>.<start>.stacks.txt`."""
    return Path(log_path).with_suffix(".stacks.txt")


def dead_engine_title(engine_id: str, slot: int, start: int, why: str, node: str | None = None) -> str:
    """The report's first line: which engine (and where), and why the fleet declared it dead."""
    where = f" on {node}" if node else ""
    return f"engine {engine_id} (slot {slot}, start {start}){where} declared dead: {why}"


async def stacks_report(pid: int, title: str) -> str:
    """The report of `pid`'s process group: `title`, each process's facts, then its stacks."""
    pids = group_pids(pid)
    lines = [title, f"taken {time.strftime('%Y-%m-%d %H:%M:%S')}, process group of pid {pid}", ""]
    if not pids:
        lines.append("no process left in the engine's process group (it exited)")
    for facts in map(process_facts, pids):
        limits = "/".join(facts["max_open_files"]) if facts["max_open_files"] else "?"
        lines.append(f"pid {facts['pid']} {facts['command']} (state {facts['state']}): {facts['fds']} open fds "
                     f"({facts['sockets']} sockets), max open files soft/hard {limits}")
    for proc in await dump_stacks(pids, find_py_spy()):
        name = f"pid {proc['pid']} {proc['command']}"
        lines += ["", f"==== {name}: Python stacks", proc["stack"].rstrip()]
        if "native_stack" in proc:
            lines += ["", f"==== {name}: with native frames", proc["native_stack"].rstrip()]
    return "\n".join(lines) + "\n"
