"""`miles-lite train` with LoRA adapters on reference engines: adapter-only pushes (as directories and inside
the requests; async rollouts) and merged pushes, each verified by the probe, the run's checkpoint holding only
adapters, the base bit-identical after training, and a stopped run resumed by a new process ending on the
straight run's adapters bit for bit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from miles_lite.checkpoint import CheckpointReader, newest_complete
from miles_lite.trainer.hf_convert import read_hf_state, tensor_sha256

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

SHORT = ["experiment.warmup_steps=10", "data.presample.enabled=false", "rollout.prompts_per_step=2",
         "rollout.group_size=4", "rollout.max_new_tokens=16", "data.synthetic.eval_size=4",
         "observability.progress=false", "experiment.steps=2", "trainer.lora.rank=4", "trainer.lora.alpha=8",
         "rollout.engines=1", "rewards.set=correctness_only", "rewards.custom=lora_signal:varied",
         "+rewards.weights.varied=1.0"]
# A short LoRA warm-up on a random model earns no task reward yet; this one differs between any two
# completions that use different characters, so every group has signal and RL trains.
SIGNAL = ("def varied(completions, *, answers, questions, steps):\n"
          "    return [len(set(c)) / 64 for c in completions]\n")


def _train(tmp_path: Path, name: str, *extra: str) -> Path:
    cmd = [sys.executable, "-m", "miles_lite.cli", "train", f"experiment.output_dir={tmp_path}",
           f"experiment.run_name={name}", *SHORT, *extra]
    (tmp_path / "plugins").mkdir(exist_ok=True)
    (tmp_path / "plugins" / "lora_signal.py").write_text(SIGNAL)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "plugins"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1100, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return tmp_path / name


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_adapter_push_moves_only_the_adapter(tmp_path: Path) -> None:
    # One-step-off rollouts, and a KL penalty whose reference is the frozen base (the adapters switched off).
    run = _train(tmp_path, "adapter", "rollout.async_steps=1", "rollout.max_staleness=1", "algo.kl_coef=0.01")
    reader = CheckpointReader(newest_complete(run / "checkpoints"))  # type: ignore[arg-type]
    adapters = {n[len("model/"):]: reader.global_tensor(n) for n in reader.global_names("model/")}
    assert adapters and all(".lora_A.weight" in n or ".lora_B.weight" in n for n in adapters)
    assert all(n.startswith("optim/") and "lora_" in n for n in reader.global_names("optim/"))
    assert reader.shared()["lora"]["base"] == {"hf_path": str(run / "initial_model")}
    assert any(float(t.abs().max()) > 0 for n, t in adapters.items() if "lora_B" in n)  # the adapters moved
    adapter_bytes = sum(t.numel() * t.element_size() for t in adapters.values())
    steps = _metrics(run)
    assert [m["step"] for m in steps] == [1, 2]
    # RL trained on every step (groups with signal), with the KL term against the base.
    assert all(m["algo/trained_sequences"] > 0 and "loss/kl" in m for m in steps), steps
    for m in steps:
        assert m["sync/bytes"] == adapter_bytes
        # The engines never received base weights: they serve the initial base plus the pushed adapter, so the
        # probe agreeing with the trainer also shows the trainer's base did not move.
        assert m["sync/probe_logp_diff_mean"] < 1e-5
    # Only the version the engines serve is kept on disk, as a PEFT adapter directory.
    kept = sorted(p.name for p in (run / "adapters").iterdir())
    assert len(kept) == 1 and {p.name for p in (run / "adapters" / kept[0]).iterdir()} == {
        "adapter_config.json", "adapter_model.safetensors"}
    log = "".join(p.read_text() for p in (run / "logs").glob("reference-*.log"))
    assert "--enable-lora" in log


def test_tensor_push_sends_the_adapter_inside_the_load_requests(tmp_path: Path) -> None:
    # weight_sync.lora=tensors: no adapter directory anywhere; each engine loads every version from the request.
    run = _train(tmp_path, "tensors", "weight_sync.lora=tensors", "rollout.async_steps=1", "rollout.max_staleness=1")
    reader = CheckpointReader(newest_complete(run / "checkpoints"))  # type: ignore[arg-type]
    adapter_bytes = sum(reader.global_tensor(n).numel() * 4 for n in reader.global_names("model/"))
    steps = _metrics(run)
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:
        assert m["sync/bytes"] == adapter_bytes and m["sync/probe_logp_diff_mean"] < 1e-5, m
    assert not (run / "adapters").exists()
    log = "".join(p.read_text() for p in (run / "logs").glob("reference-*.log"))
    loaded = [line for line in log.splitlines() if "loaded LoRA adapter" in line]
    # The warm-up's weights, then one version per step, each from the request's tensors.
    assert len(loaded) >= 3 and all("from the request's tensors" in line for line in loaded), loaded


def test_colocated_handoff_keeps_the_engines_base_and_verifies_every_adapter_push(tmp_path: Path) -> None:
    # The engines sleep while the trainer trains. The reference engine, like SGLang, loses released weights
    # (no host copy), so an adapter-only push after a wake that released the base would fail verification.
    run = _train(tmp_path, "colo", "cluster.placement=colocated")
    steps = _metrics(run)
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:
        assert m["time/engine_sleep_seconds"] > 0 and m["time/engine_wake_seconds"] > 0, m
        assert 0 < m["sync/bytes"] < 1e6 and m["sync/probe_logp_diff_mean"] < 1e-5, m
    (log,) = (run / "logs").glob("reference-*.log")
    released = [line.split("released memory ", 1)[1] for line in log.read_text().splitlines()
                if "released memory " in line]
    assert released and set(released) == {"['kv_cache', 'cuda_graph']"}, released


def test_merged_push_sends_full_weights(tmp_path: Path) -> None:
    run = _train(tmp_path, "merged", "weight_sync.lora=merged", "experiment.steps=1", "algo=gspo")
    reader = CheckpointReader(newest_complete(run / "checkpoints"))  # type: ignore[arg-type]
    adapter_bytes = sum(reader.global_tensor(n).numel() * 4 for n in reader.global_names("model/"))
    model_bytes = sum(p.stat().st_size for p in (run / "initial_model").glob("*.safetensors"))
    (m,) = _metrics(run)
    assert m["sync/bytes"] > 10 * adapter_bytes and m["sync/bytes"] > 0.9 * model_bytes - 10_000
    assert m["sync/probe_logp_diff_mean"] < 1e-4


def _tensors(reader: CheckpointReader, prefix: str) -> dict[str, torch.Tensor]:
    return {n: reader.global_tensor(n) for n in reader.global_names(prefix)}


def test_base_untouched_adapters_moved_and_resume_is_bit_exact(tmp_path: Path) -> None:
    # Rollouts are seeded, so both runs train on the same tokens; the engines' log-probs (the importance
    # weights' denominator) vary in their last bits with how requests were batched, so the weights are off.
    steps = ["experiment.steps=2", "checkpoint.interval=1", "checkpoint.keep_last=2", "algo.is_level=none"]
    straight = _train(tmp_path, "straight", *steps)
    kept = sorted((straight / "checkpoints").glob("step_*"))
    assert [p.name for p in kept][-2:] == ["step_00000001", "step_00000002"], kept
    first, last = (CheckpointReader(p) for p in kept[-2:])

    # The base: every tensor the trainer held after training (fingerprinted at the save) has the bits of the
    # initial model it loaded, and nothing else is in the fingerprint.
    lora = last.shared()["lora"]
    initial = read_hf_state(straight / "initial_model")
    assert lora["base_dtype"] == "float32" and lora["base_sha256"]
    assert set(lora["base_sha256"]) <= set(initial) and set(initial) - set(lora["base_sha256"]) <= {"lm_head.weight"}
    for name, digest in lora["base_sha256"].items():
        assert digest == tensor_sha256(initial[name]), name
    assert first.shared()["lora"]["base_sha256"] == lora["base_sha256"]
    # The adapters: every B left zero, and RL's second step moved every A and B.
    before, after = _tensors(first, "model/"), _tensors(last, "model/")
    assert set(before) == set(after) and len(after) == 2 * 2 * 7  # layers x targets x (A, B)
    for name, tensor in after.items():
        assert not torch.equal(tensor, before[name]), name
        if "lora_B" in name:
            assert float(tensor.abs().max()) > 0, name

    # Resume: 1 step, then a new process resumes from its checkpoint and runs the second.
    _train(tmp_path, "resumed", "experiment.steps=1", *steps[1:])
    resumed = _train(tmp_path, "resumed", *steps)
    assert [m["step"] for m in _metrics(resumed)] == [1, 2]
    end = CheckpointReader(newest_complete(resumed / "checkpoints"))  # type: ignore[arg-type]
    assert end.shared()["counters"]["steps_done"] == last.shared()["counters"]["steps_done"]
    for prefix in ("model/", "optim/"):  # adapters, then their Adam moments
        want, got = _tensors(last, prefix), _tensors(end, prefix)
        assert want and set(got) == set(want), prefix
        for name, tensor in want.items():
            assert torch.equal(got[name], tensor), name
    assert end.shared()["optimizer"] == last.shared()["optimizer"]  # step counts, parameter groups
