"""`scripts/gpu_checks.sh` samples the card's clocks while its parts run (`nvidia-smi ... -l 5` into
OUT/gpu-clocks.csv, stopped when the checks end) and `scripts/gpu_summary.py` gives each part its clocks, power,
heat and the clock-event reasons of its slow samples, from the parts' start times in parts.tsv."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import datetime, timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

from gpu_summary import clocks_table  # noqa: E402

FAKE_SMI = """#!/bin/sh
# The field probe (no -l): answer as a driver that knows clocks_event_reasons does.
case "$*" in *" -l "*) ;; *) echo "clocks_event_reasons.active"; exit 0 ;; esac
echo "$*" > "{log}"
echo $$ > "{pid}"
while :; do  # a sample pair every 0.2 s until the checks end it
  now=$(date '+%Y/%m/%d %H:%M:%S').000
  echo "$now, 1980, 1980, 350.50, 61, 100, 0x0000000000000000"
  echo "$now, 495, 1980, 699.10, 88, 100, 0x0000000000000008"
  sleep 0.2
done
"""


def test_the_checks_sample_the_clocks_and_stop_the_sampler(tmp_path: Path) -> None:
    bindir, out = tmp_path / "bin", tmp_path / "out"
    bindir.mkdir()
    smi = bindir / "nvidia-smi"
    smi.write_text(FAKE_SMI.format(log=tmp_path / "smi-args", pid=tmp_path / "smi-pid"))
    smi.chmod(0o755)
    env = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}", "PYTHON": sys.executable}
    # `versions` asks torch for the device's name: on this CPU machine the part fails, which is all it needs to do.
    subprocess.run(["bash", "scripts/gpu_checks.sh", str(out), "versions"], cwd=REPO, env=env, timeout=300,
                   capture_output=True)
    args = (tmp_path / "smi-args").read_text()
    assert "clocks.sm,clocks.max.sm,power.draw,temperature.gpu,utilization.gpu,clocks_event_reasons.active" in args
    assert "-l 5" in args
    pid = int((tmp_path / "smi-pid").read_text())
    try:
        os.kill(pid, 0)
        alive = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except ProcessLookupError:
        alive = False
    assert not alive, "the sampler outlived the checks"
    name, status, seconds, started = (out / "parts.tsv").read_text().splitlines()[0].split("\t")
    assert (name, status) == ("versions", "failed") and int(seconds) >= 0
    datetime.strptime(started, "%Y/%m/%d %H:%M:%S")
    summary = (out / "summary.md").read_text()
    assert "## The card's clocks per part" in summary
    assert "| versions | " in summary and "| 0x0000000000000008 |" in summary


def _sample(t: datetime, sm: int, power: float, temp: int, reasons: str) -> str:
    return f"{t:%Y/%m/%d %H:%M:%S}.123, {sm}, 1980, {power:.2f}, {temp}, 100, {reasons}"


def test_each_part_gets_its_own_samples(tmp_path: Path) -> None:
    t0 = datetime(2026, 12, 7, 16, 36, 0)
    (tmp_path / "parts.tsv").write_text(
        f"rollout\tok\t60\t{t0:%Y/%m/%d %H:%M:%S}\n"
        f"guard-7b-bf16\tok\t20\t{t0 + timedelta(seconds=61):%Y/%m/%d %H:%M:%S}\n"
        "colocated-0.5b\tok\t300\n")  # a row without a start (older sittings) is left out
    rows = ["Failed to initialize NVML: Unknown Error"]  # not a sample: skipped
    rows += [_sample(t0 + timedelta(seconds=5 * i), 1980 if i < 8 else 600, 400 + i, 60 + i,
                     "0x0000000000000000" if i < 8 else "0x0000000000000004") for i in range(12)]
    rows += [_sample(t0 + timedelta(seconds=65 + 5 * i), 1755, 650, 70, "0x0000000000000000") for i in range(3)]
    (tmp_path / "gpu-clocks.csv").write_text("\n".join(rows) + "\n")
    table = clocks_table(tmp_path)
    assert table[2:] == [
        "| rollout | 1980 (600) | 4 of 12 | 411 | 71 | 0x0000000000000004 |",
        "| guard-7b-bf16 | 1755 (1755) | 3 of 3 | 650 | 70 | 0x0000000000000000 |",
    ]


def test_no_samples_no_table(tmp_path: Path) -> None:
    (tmp_path / "parts.tsv").write_text("rollout\tok\t60\t2026/12/07 16:36:00\n")
    assert clocks_table(tmp_path) == []
