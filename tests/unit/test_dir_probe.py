"""The run's directories probed before any work: the checkpoint root only when the run saves checkpoints."""

from __future__ import annotations

from pathlib import Path

import pytest

from miles_lite.config import load_config
from miles_lite.run.dir_probe import OutputDirError, probe_run_dirs


def test_a_run_without_checkpoints_needs_no_room_for_one(tmp_path: Path) -> None:
    # A model whose checkpoint cannot fit anywhere: only a run that saves checkpoints is refused for it.
    model = tmp_path / "model"
    model.mkdir()
    with open(model / "model.safetensors", "wb") as f:
        f.truncate(1 << 42)  # sparse: 2^41 parameters by the estimate, a 24 TiB checkpoint
    saving = load_config([f"model.hf_path={model}"])
    with pytest.raises(OutputDirError, match=r"experiment.output_dir=.* MiB free, and one checkpoint"):
        probe_run_dirs(saving, tmp_path / "a", tmp_path / "a" / "checkpoints")

    none = load_config([f"model.hf_path={model}", "checkpoint.dir=''"])
    probe_run_dirs(none, tmp_path / "b", tmp_path / "b" / "checkpoints")
    assert (tmp_path / "b").is_dir() and not (tmp_path / "b" / "checkpoints").exists()
