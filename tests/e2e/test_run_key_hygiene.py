"""A default `miles-lite train` run with API keys on: the engines ask for the run's fresh key, and the key
appears in no command line or environment of any process the run starts, in nothing the run writes to its
run directory or prints, and its private file is gone when the run ends.

While the run lives, every process below it (found through /proc's parent links) is sampled: its command
line, environment and, for an engine, the key file it was given.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from miles_lite.net.api_key import ENV_KEY, ENV_KEY_FILE

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SHORT = ["experiment.steps=2", "experiment.warmup_steps=4", "data.synthetic.eval_size=16",
         "observability.progress=false", "experiment.run_name=keys"]


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        tree.setdefault(ppid, []).append(int(entry))
    return tree


def _descendants(root: int) -> list[int]:
    tree, out, todo = _children(), [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += tree.get(pid, [])
    return out


def _read(path: str) -> bytes | None:
    try:
        return Path(path).read_bytes()
    except OSError:
        return None


def test_default_run_keeps_its_key_out_of_argv_environment_and_run_dir(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in (ENV_KEY, ENV_KEY_FILE)}
    cmd = [sys.executable, "-m", "miles_lite.cli", "train", f"experiment.output_dir={tmp_path}", *SHORT]
    seen: dict[int, tuple[bytes, bytes]] = {}  # pid -> (cmdline, environ), as last sampled
    key_files: set[str] = set()
    keys: set[bytes] = set()
    with open(tmp_path / "out.log", "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        while proc.poll() is None:
            for pid in _descendants(proc.pid):
                cmdline, environ = _read(f"/proc/{pid}/cmdline"), _read(f"/proc/{pid}/environ")
                if cmdline is None or environ is None:
                    continue
                seen[pid] = (cmdline, environ)
                argv = cmdline.split(b"\0")
                if b"--api-key-file" in argv:
                    key_files.add(argv[argv.index(b"--api-key-file") + 1].decode())
            # Engines started ahead get their argv over a socket: the launcher writes it to the engine's log.
            for log_file in (tmp_path / "keys" / "logs").glob("reference-*.log"):
                words = (_read(str(log_file)) or b"").split(b"\n", 1)[0].split()
                if b"--api-key-file" in words[:-1]:
                    key_files.add(words[words.index(b"--api-key-file") + 1].decode())
            for path in key_files:
                key = _read(path)
                if key:
                    keys.add(key.strip())
            time.sleep(0.2)  # the sampling period of the process table
    log = (tmp_path / "out.log").read_bytes()
    assert proc.returncode == 0, log[-3000:].decode(errors="replace")

    # Two reference engines, both given the same fresh key through one private file outside the run.
    engines = [c for c, _ in seen.values() if b"miles_lite.engines.reference.engine" in c]
    assert len(engines) >= 2, [c[:120] for c, _ in seen.values()]
    assert len(key_files) == 1 and len(keys) == 1, (key_files, len(keys))
    (key,) = keys
    (key_file,) = key_files
    assert len(key) >= 40
    assert not Path(key_file).is_relative_to(tmp_path)
    assert not Path(key_file).exists() and not Path(key_file).parent.exists()  # removed with the run

    for pid, (cmdline, environ) in seen.items():
        assert key not in cmdline, f"the key is on the command line of pid {pid}: {cmdline[:200]!r}"
        assert key not in environ, f"the key is in the environment of pid {pid}: {cmdline[:200]!r}"
    assert key not in log
    run_dir = tmp_path / "keys"
    files = [p for p in run_dir.rglob("*") if p.is_file()]
    assert any(p.name == "config.yaml" for p in files) and any(p.suffix == ".log" for p in files)
    for path in files:
        assert key not in path.read_bytes(), f"the key is in {path}"
    engine_logs = [p.read_text() for p in (run_dir / "logs").glob("reference-*.log")]
    assert len(engine_logs) >= 2 and all("API key required" in text for text in engine_logs)
