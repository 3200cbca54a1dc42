"""Reference engines started ahead of their run: adopted by the launcher they serve like a freshly spawned
engine (logging to the run's log, on the socket the launcher bound); unadopted they end when their pool closes;
and `miles-lite train` with a configuration that fails validation leaves none behind."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import uuid
from pathlib import Path

from miles_lite.config.schema import RolloutConfig, TinyModelShape
from miles_lite.engines.launcher import EngineLauncher
from miles_lite.engines.reference.prestart import prestart_engines
from miles_lite.trainer.tiny_hf import make_tiny_hf_model
from miles_lite.types import SamplingParams


def _with_marker(marker: str) -> list[int]:
    """Pids of live processes whose environment holds `MARK=<marker>`."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if f"MARK={marker}".encode() in f.read().split(b"\0"):
                    found.append(int(entry))
        except OSError:
            continue
    return found


def test_a_prestarted_engine_is_adopted_and_serves(tmp_path: Path) -> None:
    model = make_tiny_hf_model("qwen2", TinyModelShape(), 512, tmp_path / "model", seed=0)
    marker = uuid.uuid4().hex
    rollout = RolloutConfig(backend="reference", engines=2, engine_env={"MARK": marker})
    pool = prestart_engines(rollout)
    assert pool is not None and len(_with_marker(marker)) >= 2
    launcher = EngineLauncher(rollout, str(model), str(tmp_path / "logs"), prestarted=pool)

    async def scenario() -> tuple[tuple[int, ...], int]:
        engine = await launcher.start(0)
        try:
            gen = await engine.client.generate([1, 2, 3], SamplingParams(max_new_tokens=3, temperature=0.0))
            return gen.output_ids, engine.process.pid
        finally:
            await launcher.stop(engine)

    (tmp_path / "logs").mkdir()
    ids, pid = asyncio.run(scenario())
    assert len(ids) == 3
    log = (tmp_path / "logs" / "reference-0.0.log").read_text()
    assert f"(started ahead: pid {pid})" in log and "reference engine serving" in log
    unused = pool.take(1)  # engine 1 was never adopted: discarded, it ends and its early log goes
    assert unused is not None and Path(unused.early_log).is_file()
    unused.discard()
    assert unused.proc.returncode is not None and not Path(unused.early_log).exists()
    pool.close()
    assert not _with_marker(marker)


def test_a_bad_configuration_leaves_no_engine_started_ahead(tmp_path: Path) -> None:
    marker = uuid.uuid4().hex
    proc = subprocess.run([sys.executable, "-m", "miles_lite.cli", "train", f"experiment.output_dir={tmp_path / 'out'}",
                           "trainer.lr=-1", f"+rollout.engine_env.MARK={marker}"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "trainer.lr" in proc.stderr, proc.stderr[-2000:]
    assert not _with_marker(marker) and not (tmp_path / "out").exists()
