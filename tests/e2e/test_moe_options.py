"""Mixture-of-experts options through `miles-lite train`: rollout routing replay starts SGLang engines with
`--enable-return-routed-experts` (without it SGLang returns no routing and the trainer silently routed the
generated tokens itself), and a bf16 run verifies its pushes under a probe bound chosen for its precision and
architecture (the fixed 1e-3 stopped bf16 Qwen3-MoE runs at their first push)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from miles_lite.observability.sinks import read_metrics_file

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SHORT = ["observability.progress=false", "experiment.run_name=run", "experiment.warmup=none",
         "data.presample.enabled=false", "experiment.eval_size=0", "rollout.engines=1", "rollout.prompts_per_step=2",
         "rollout.group_size=2", "rollout.max_new_tokens=16", "model=tiny_qwen3_moe", "trainer.routing_replay=true",
         "algo.drop_zero_signal=false"]

# A stand-in for SGLang 0.5.17's `sglang` package on the engines' path: its launch parser knows the flags a run
# passes (as 0.5.17 declares them), and its server records the command line it was given, then exits.
FAKE_SERVER_ARGS = '''
import json, os, sys

FLAGS = ("--model-path", "--host", "--port", "--tp-size", "--skip-tokenizer-init", "--mem-fraction-static",
         "--disable-prefill-cuda-graph", "--cuda-graph-max-bs", "--cuda-graph-max-bs-decode", "--custom-weight-loader",
         "--base-gpu-id", "--enable-return-routed-experts", "--enable-memory-saver")


class ServerArgs:
    @staticmethod
    def add_cli_args(parser):
        for flag in FLAGS:
            parser.add_argument(flag, nargs="*")


def prepare_server_args(argv):
    with open(os.environ["FAKE_SGLANG_ARGV"], "a") as f:
        f.write(json.dumps(argv) + "\\n")
    sys.exit(3)
'''


def _train(out: Path, *overrides: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "miles_lite.cli", "train", f"experiment.output_dir={out}", *SHORT,
                           *overrides], capture_output=True, text=True, timeout=500, env=env)


def test_routing_replay_starts_sglang_engines_returning_routed_experts(tmp_path: Path) -> None:
    package = tmp_path / "fake" / "sglang"
    for sub in ("", "srt", "srt/entrypoints"):
        (package / sub).mkdir(parents=True, exist_ok=True)
        (package / sub / "__init__.py").write_text("")
    (package / "srt" / "entrypoints" / "http_server.py").write_text("")
    (package / "srt" / "server_args.py").write_text(FAKE_SERVER_ARGS)
    argv_log = tmp_path / "argv.jsonl"
    env = {**os.environ, "FAKE_SGLANG_ARGV": str(argv_log),
           "PYTHONPATH": os.pathsep.join([str(tmp_path / "fake"), os.environ.get("PYTHONPATH", "")])}
    proc = _train(tmp_path / "out", "rollout=sglang", "rollout.max_new_tokens=16",
                  "fault_tolerance.max_engine_restarts=0", env=env)
    assert proc.returncode != 0  # the stand-in server exits at once
    (argv, *_) = [json.loads(line) for line in argv_log.read_text().splitlines()]
    assert "--enable-return-routed-experts" in argv, argv


def test_a_bf16_moe_run_verifies_its_pushes_under_a_bound_chosen_for_it(tmp_path: Path) -> None:
    # bf16 against fp32 reference engines on this shape: a probe gap of about 0.0013 (over the old fixed 1e-3).
    proc = _train(tmp_path, "trainer.precision=bf16", "model.shape.hidden_size=128", "model.shape.num_layers=4",
                  "experiment.steps=1")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (step,) = read_metrics_file(tmp_path / "run")
    assert step["sync/probe_logp_diff_bound"] == pytest.approx(0.02)
    assert step["sync/probe_logp_diff_mean"] < 0.02
    assert 0.0 <= step["moe/router_agreement"] <= 1.0
