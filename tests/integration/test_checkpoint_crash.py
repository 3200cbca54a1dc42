"""Crash safety: a process SIGKILLed in the middle of a flush leaves the previous checkpoint intact."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from miles_lite.checkpoint import AsyncCheckpointer, CheckpointReader, newest_complete
from miles_lite.checkpoint.layout import read_latest, step_dir_name

# Step 1: a small committed checkpoint. Step 2: 256 MiB whose flush is interrupted.
_CHILD = """
import sys, time, torch
from miles_lite.checkpoint import AsyncCheckpointer, CheckpointPayload, GlobalPiece
saver = AsyncCheckpointer(sys.argv[1], keep_last=2)
saver.save(1, CheckpointPayload(pieces=[GlobalPiece.whole("w", torch.full((64, 64), 1.0))], shared={"step": 1}))
saver.finalize()
big = [torch.full((1024, 1024), float(i)) for i in range(64)]
saver.save(2, CheckpointPayload(pieces=[GlobalPiece.whole(f"t{i}", t) for i, t in enumerate(big)],
                                shared={"step": 2}))
saver.finalize()
print("finished", flush=True)
"""


def _poll(condition, timeout_s: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.002)


def _partial_rank_file(root: Path) -> bool:
    for tmp in root.glob("tmp-step_00000002-*"):
        f = tmp / "rank_00000.safetensors"
        if f.is_file() and f.stat().st_size > 0:
            return True
    return False


@pytest.mark.timeout(300)
def test_sigkill_during_flush_keeps_previous_checkpoint(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(root)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        _poll(lambda: _partial_rank_file(root) or child.poll() is not None, 240, "the step-2 flush to start")
        assert child.poll() is None, f"child exited before the kill: {child.communicate()}"
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL
    # The interrupted save left a partial temporary directory and nothing else.
    leftovers = list(root.glob("tmp-step_00000002-*"))
    assert len(leftovers) == 1
    assert not (root / step_dir_name(2)).exists()
    assert read_latest(root) == step_dir_name(1)
    path = newest_complete(root)
    assert path == root / step_dir_name(1)
    reader = CheckpointReader(path)  # every checksum verified
    assert reader.shared() == {"step": 1} and torch.equal(reader.global_tensor("w"), torch.full((64, 64), 1.0))
    # The next start cleans the stale temporary directory.
    saver = AsyncCheckpointer(root)
    assert saver.cleaned == leftovers and not leftovers[0].exists()
    saver.close()
