"""Combinations the configuration accepts, each run through `miles-lite train` on one GPU:

- `trainer.offload.optimizer_cpu=true` with checkpoints: a run stopped after step 1 and resumed ends at step 2
  with the weights of a run that went through (Megatron's CPU-offloaded optimizer steps host copies of the main
  parameters with CPU optimizers of its own; a resume must reach those, `trainer/dist_optimizer.py`);
- LoRA with an FP8 trainer: adapters trained on TransformerEngine FP8 layers, every push verified;
- the hand-off with an FP8 trainer: SGLang and the FP8 trainer sharing the GPU, the engine asleep while the
  trainer trains and the trainer's state in host memory while the engine generates, every push verified.

The trainer is a tiny Qwen2 on the TE layers; the first two use CPU reference engines, the hand-off a stock SGLang
(`MILES_ENGINE_PYTHONPATH`: SGLang installed apart). `scripts/gpu_checks.sh OUT combinations` runs this file.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from miles_lite.engines.sglang.command import sglang_importable

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# Tiny model, short rollouts, every group trained; a learning rate large enough for one Adam step to show.
SHORT = ["experiment.warmup=none", "experiment.eval_size=0", "data.presample.enabled=false",
         "algo.drop_zero_signal=false", "rollout.prompts_per_step=4", "rollout.group_size=2",
         "rollout.max_new_tokens=16", "rollout.async_steps=0", "observability.progress=false",
         "model.shape.hidden_size=256", "model.shape.num_attention_heads=4", "model.shape.num_kv_heads=2",
         "model.shape.ffn_hidden_size=512", "trainer.lr=1e-3"]


def _train(out: Path, name: str, *overrides: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([sys.executable, "-u", "-m", "miles_lite.cli", "train", f"experiment.output_dir={out}",
                           f"experiment.run_name={name}", *SHORT, *overrides],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=1500)
    print(done.stdout[-3000:])
    assert done.returncode == 0, done.stdout[-6000:]
    return done


def _steps(run: Path) -> list[dict]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "time/train_seconds" in r]


def _weights(checkpoints: Path, out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    subprocess.run([sys.executable, "-m", "miles_lite.cli", "convert", "--to-hf", str(checkpoints), str(out)],
                   check=True, capture_output=True, text=True, timeout=600)
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(out.glob("*.safetensors")):
        tensors.update({k: v.float() for k, v in load_file(str(f)).items()})
    return tensors


def test_optimizer_cpu_offload_resumes_like_a_run_that_went_through(tmp_path: Path) -> None:
    # The entropy term gives every step a gradient (a tiny model from random weights scores 0 on every sample,
    # so its advantages are 0), and no rate warm-up: steps 1 and 2 both move the weights and the Adam moments.
    offload = ["trainer=gpu_bf16", "trainer.use_distributed_optimizer=true", "trainer.offload.optimizer_cpu=true",
               "checkpoint.interval=1", "algo.entropy_coef=0.01", "trainer.lr_warmup_steps=0"]
    _train(tmp_path, "through", *offload, "experiment.steps=2")
    _train(tmp_path, "resumed", *offload, "experiment.steps=1")
    resumed = _train(tmp_path, "resumed", *offload, "experiment.steps=2")
    assert "resumed from " in resumed.stdout and "at step 1" in resumed.stdout
    through = _weights(tmp_path / "through" / "checkpoints", tmp_path / "hf-through")
    again = _weights(tmp_path / "resumed" / "checkpoints", tmp_path / "hf-resumed")
    step1 = _weights(tmp_path / "resumed" / "checkpoints" / "step_00000001", tmp_path / "hf-step1")
    assert set(through) == set(again)
    for name, want in through.items():
        moved = float((want - step1[name]).abs().max())  # what step 2 changed
        gap = float((again[name] - want).abs().max())
        # Lost Adam moments or host copies left at the step-0 values would be off by a whole step's update.
        assert gap <= 0.05 * moved + 1e-6, (name, gap, moved)
    assert any(float((through[n] - step1[n]).abs().max()) > 0 for n in through)  # step 2 changed the weights
    for r in _steps(tmp_path / "resumed"):
        assert r["skipped"] == 0.0 and r["sync/probe_logp_diff_mean"] < r["sync/probe_logp_diff_bound"]


def test_lora_with_an_fp8_trainer_trains_the_adapters_and_verifies_every_push(tmp_path: Path) -> None:
    _train(tmp_path, "run", "trainer=gpu_fp8", "trainer.lora.rank=8", "trainer.lora.alpha=16", "experiment.steps=3")
    steps = _steps(tmp_path / "run")
    assert len(steps) == 3
    for r in steps:
        assert r["skipped"] == 0.0 and r["sync/bytes"] > 0
        assert r["sync/probe_logp_diff_mean"] < r["sync/probe_logp_diff_bound"], r
    assert any(r["grad_norm"] > 0 for r in steps)


@pytest.mark.skipif(not (os.environ.get("MILES_ENGINE_PYTHONPATH") or sglang_importable()),
                    reason="needs sglang (importable, or MILES_ENGINE_PYTHONPATH)")
def test_the_hand_off_with_an_fp8_trainer_trains_and_verifies_every_push(tmp_path: Path) -> None:
    overrides = ["trainer=gpu_fp8", "rollout=sglang", "rollout.engines=1", "cluster.placement=colocated",
                 "cluster.colocated_memory=handoff", "+rollout.sglang_args.base_gpu_id=0",
                 "rollout.sglang_args.mem_fraction_static=0.3", "experiment.steps=3"]
    if os.environ.get("MILES_ENGINE_PYTHONPATH"):
        overrides.append(f"+rollout.engine_env.PYTHONPATH={os.environ['MILES_ENGINE_PYTHONPATH']}")
    if os.environ.get("MILES_TEST_TRANSPORT"):
        overrides.append(f"weight_sync.transport={os.environ['MILES_TEST_TRANSPORT']}")
    _train(tmp_path, "run", *overrides)
    steps = _steps(tmp_path / "run")
    assert len(steps) == 3
    for r in steps:
        assert r["skipped"] == 0.0
        assert r["sync/probe_logp_diff_mean"] < r["sync/probe_logp_diff_bound"], r
        assert r["time/engine_sleep_seconds"] > 0 and r["time/engine_wake_seconds"] > 0, r  # the GPU changed hands
