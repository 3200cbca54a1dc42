"""Experiment files kept outside the repository, through `miles-lite train` run from a directory of one's own:
`--config-dir DIR` is searched before the project's `conf/` (it adds to it), and `experiment=PATH.yaml` takes a
file from anywhere; a missing one is a configuration error (exit 2)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
MINE = """# @package _global_
defaults:
  - override /model: tiny_llama
experiment:
  name: {name}
  steps: 3
rollout:
  group_size: 3
"""


def _job(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "miles_lite.cli", "train", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def _resolved(proc: subprocess.CompletedProcess[str]) -> dict:
    assert proc.returncode == 0, proc.stderr[-2000:]
    return yaml.safe_load(proc.stdout)


def test_experiment_files_from_a_directory_of_ones_own(tmp_path: Path) -> None:
    (tmp_path / "my-conf" / "experiment").mkdir(parents=True)
    (tmp_path / "my-conf" / "experiment" / "mine.yaml").write_text(MINE.format(name="mine"))
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "other.yaml").write_text(MINE.format(name="other"))

    # --config-dir adds to conf/: the file's own settings, its defaults pick a shipped model, the rest is conf/'s.
    cfg = _resolved(_job(tmp_path, "--config-dir", "my-conf", "experiment=mine", "--cfg", "job"))
    assert cfg["experiment"]["name"] == "mine" and cfg["experiment"]["steps"] == 3
    assert cfg["rollout"]["group_size"] == 3 and cfg["model"]["arch"] == "llama"
    assert cfg["rollout"]["backend"] == "reference" and cfg["algo"]["advantage_estimator"] == "grpo"
    # A shipped experiment still composes with --config-dir given.
    assert _resolved(_job(tmp_path, "--config-dir", "my-conf", "--cfg", "job"))["experiment"]["name"] == "tiny_cpu"

    # experiment=PATH.yaml, relative to where the command runs or absolute.
    for given in ("elsewhere/other.yaml", str(tmp_path / "elsewhere" / "other.yaml")):
        cfg = _resolved(_job(tmp_path, f"experiment={given}", "trainer.lr=0.01", "--cfg", "job"))
        assert cfg["experiment"]["name"] == "other" and cfg["model"]["arch"] == "llama"
        assert cfg["trainer"]["lr"] == 0.01


def test_a_missing_file_or_directory_is_a_configuration_error(tmp_path: Path) -> None:
    proc = _job(tmp_path, "experiment=nope.yaml", "--cfg", "job")
    assert proc.returncode == 2 and "configuration error: experiment=nope.yaml: no such file" in proc.stderr
    assert "Traceback" not in proc.stderr
    proc = _job(tmp_path, "--config-dir", "missing", "--cfg", "job")
    assert proc.returncode == 2 and "--config-dir missing: no such directory" in proc.stderr
