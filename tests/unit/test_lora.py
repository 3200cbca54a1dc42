"""LoRA pieces without a trainer: PEFT format, fused-row layout, engine flags, config checks, the adapter push."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

import pytest
import torch
from fake_rollout_engine import FakeEngine

from miles_lite.config.lora_serving import with_lora_serving
from miles_lite.config.schema import MilesConfig
from miles_lite.config.validate import ConfigError, validate
from miles_lite.engines.reference.engine import reference_flags
from miles_lite.engines.sglang.command import sglang_flag_args
from miles_lite.formats.lora import (
    MODULE_PATHS,
    TARGETS,
    LoraSpec,
    adapter_payload,
    load_adapter_dir,
    merged_state,
    read_adapter_payload,
    save_adapter_dir,
    tensor_name,
)
from miles_lite.trainer.hf_convert import layout_for
from miles_lite.trainer.lora import fuse_rows
from miles_lite.trainer.model import spec_from_hf_config
from miles_lite.weight_sync.adapter_push import AdapterTransport
from miles_lite.weight_sync.plan import EngineSpec
from miles_lite.weight_sync.transport import EngineLoop, FleetEngine

SPEC = LoraSpec(2, 4.0, 0.0, ("q_proj", "down_proj"))


def test_adapter_directory_round_trip_and_merge(tmp_path: Path) -> None:
    adapter = {tensor_name(0, "q_proj", "A"): torch.randn(2, 8), tensor_name(0, "q_proj", "B"): torch.randn(6, 2)}
    save_adapter_dir(tmp_path, adapter, SPEC, "/models/base")
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["r"] == 2 and config["lora_alpha"] == 4.0 and config["peft_type"] == "LORA"
    spec, tensors = load_adapter_dir(tmp_path)
    assert spec == SPEC and all(torch.equal(tensors[n], t) for n, t in adapter.items())
    base = {"model.layers.0.self_attn.q_proj.weight": torch.randn(6, 8), "model.norm.weight": torch.ones(8)}
    merged = merged_state(base, adapter, SPEC)
    a, b = adapter[tensor_name(0, "q_proj", "A")], adapter[tensor_name(0, "q_proj", "B")]
    assert torch.allclose(merged["model.layers.0.self_attn.q_proj.weight"],
                          base["model.layers.0.self_attn.q_proj.weight"] + 2.0 * b @ a)
    assert merged["model.norm.weight"] is base["model.norm.weight"]
    with pytest.raises(ValueError, match="lora_A or lora_B"):
        save_adapter_dir(tmp_path / "half", {tensor_name(0, "q_proj", "A"): a}, SPEC, None)
    with pytest.raises(ValueError, match="use_dora"):
        LoraSpec.from_peft_config({**config, "use_dora": True})


@pytest.mark.parametrize("tp", [1, 2])
def test_fused_rows_follow_the_megatron_layouts(tp: int) -> None:
    """Per-projection rows laid out by `fuse_rows` are exactly what the weight layouts assemble from HF tensors."""
    spec = spec_from_hf_config({"model_type": "qwen2", "vocab_size": 32, "hidden_size": 16, "intermediate_size": 24,
                                "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
                                "rope_theta": 1e4})
    hf = {f"model.layers.0.{p}.weight": torch.randn(o, 16) for p, o in
          (("self_attn.q_proj", 16), ("self_attn.k_proj", 8), ("self_attn.v_proj", 8), ("mlp.gate_proj", 24),
           ("mlp.up_proj", 24))}
    for rank in range(tp):
        for path, names, out in (("self_attention.linear_qkv", ("q_proj", "k_proj", "v_proj"), 32),
                                 ("mlp.linear_fc1", ("gate_proj", "up_proj"), 48)):
            layout = layout_for(f"decoder.layers.0.{path}.weight", (out // tp, 16), spec, rank, tp, 32)
            parts = {t: hf[f"model.layers.0.{MODULE_PATHS[t]}.weight"].chunk(tp)[rank] for t in names}
            fused = fuse_rows(path, parts, None, spec, tp, dim=0)
            assert torch.equal(fused, layout.assemble(hf))


def test_engines_get_lora_flags_only_for_adapter_pushes() -> None:
    cfg = MilesConfig()
    assert with_lora_serving(cfg) is cfg
    cfg.trainer.lora.rank = 8
    cfg.trainer.lora.targets = ["q_proj", "v_proj"]
    served = with_lora_serving(cfg)
    argv = sglang_flag_args(served.rollout.sglang_args)
    assert "--enable-lora" in argv and argv[argv.index("--max-lora-rank") + 1] == "8"
    i = argv.index("--lora-target-modules")
    assert argv[i + 1:i + 3] == ["q_proj", "v_proj"]
    assert reference_flags(served.rollout.reference_args) == ["--enable-lora", "--max-lora-rank", "8"]
    cfg.weight_sync.lora = "merged"
    assert with_lora_serving(cfg) is cfg


def test_bad_lora_targets_name_the_field() -> None:
    cfg = MilesConfig()
    cfg.trainer.lora.rank = 4
    cfg.trainer.lora.targets = ["q_proj", "qkv"]
    with pytest.raises(ConfigError, match=r"trainer.lora.targets=\['q_proj', 'qkv'\]: unknown \['qkv'\]"):
        validate(cfg)


@pytest.fixture()
def loop():
    ev = asyncio.new_event_loop()
    t = threading.Thread(target=ev.run_forever, daemon=True)
    t.start()
    yield EngineLoop(ev, timeout_s=10)
    ev.call_soon_threadsafe(ev.stop)
    t.join()


def test_adapter_push_loads_switches_and_unloads(tmp_path: Path, loop: EngineLoop) -> None:
    engines = [FakeEngine("e0"), FakeEngine("e1")]
    transport = AdapterTransport(LoraSpec(2, 4.0, 0.0, TARGETS[:1]), tmp_path, loop)
    transport.connect([FleetEngine(e, EngineSpec(e.engine_id, 1, 1)) for e in engines])
    adapter = {tensor_name(0, "q_proj", "A"): torch.randn(2, 8), tensor_name(0, "q_proj", "B"): torch.zeros(6, 2)}
    first = transport.push(lambda: [adapter], "1")
    assert first.bytes == (16 + 12) * 4 and first.seconds["gather"] > 0
    assert all(e.lora_name == "policy-v1-1" and list(e.adapters) == ["policy-v1-1"] and e.version == "1"
               for e in engines)
    transport.push([adapter], "2")
    # The new adapter serves; the one before was unloaded; only its directory is kept.
    assert all(e.lora_name == "policy-v2-2" and list(e.adapters) == ["policy-v2-2"] for e in engines)
    assert engines[0].adapters["policy-v2-2"] == str((tmp_path / "v2").resolve())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v2"]
    spec, tensors = load_adapter_dir(tmp_path / "v2")
    name = tensor_name(0, "q_proj", "A")
    assert spec.rank == 2 and torch.equal(tensors[name], adapter[name])


def test_adapter_payload_round_trip_and_refusals() -> None:
    import base64
    import os
    import pickle

    adapter = {tensor_name(1, "down_proj", "A"): torch.randn(2, 8).to(torch.bfloat16),
               tensor_name(1, "down_proj", "B"): torch.randn(6, 2)}
    back = read_adapter_payload(adapter_payload(adapter))
    assert set(back) == set(adapter) and all(torch.equal(back[n], t) and back[n].dtype == t.dtype
                                             for n, t in adapter.items())
    # Views of a larger tensor travel as their own values, not their base's storage.
    wide = torch.randn(4, 8)
    view = {tensor_name(0, "q_proj", "A"): wide[:2], tensor_name(0, "q_proj", "B"): torch.zeros(6, 2)}
    assert read_adapter_payload(adapter_payload(view))[tensor_name(0, "q_proj", "A")].untyped_storage().nbytes() == 64
    with pytest.raises(ValueError, match="lora_A or lora_B"):
        adapter_payload({tensor_name(0, "q_proj", "A"): torch.zeros(2, 8)})

    class Run:
        def __reduce__(self) -> tuple:
            return (os.getcwd, ())

    for bad, message in ((base64.b64encode(pickle.dumps({"x": Run()})).decode(), "tensors only, not posix.getcwd"),
                         (base64.b64encode(pickle.dumps([1, 2])).decode(), "mapping of PEFT tensor names"),
                         ("not base64!", "cannot decode the adapter payload")):
        with pytest.raises(ValueError, match=message):
            read_adapter_payload(bad)


def test_tensor_push_sends_each_version_in_the_requests(tmp_path: Path, loop: EngineLoop) -> None:
    engines = [FakeEngine("e0"), FakeEngine("e1")]
    transport = AdapterTransport(SPEC, tmp_path / "unused", loop, base_model="/models/base", via="tensors")
    transport.connect([FleetEngine(e, EngineSpec(e.engine_id, tp, 1)) for e, tp in zip(engines, (1, 2), strict=True)])
    adapter = {tensor_name(0, "q_proj", "A"): torch.randn(2, 8), tensor_name(0, "q_proj", "B"): torch.zeros(6, 2)}
    report = transport.push([adapter], "1")
    assert report.transport == "lora_tensors" and report.bytes == (16 + 12) * 4
    transport.push([adapter], "2")
    for engine, tp in zip(engines, (1, 2), strict=True):
        assert engine.lora_name == "policy-v2-2" and list(engine.adapters) == ["policy-v2-2"] and engine.version == "2"
        (name, config, per_rank), _ = engine.tensor_loads[-1], engine.tensor_loads[0]
        assert name == "policy-v2-2" and config == SPEC.peft_config("/models/base") and len(per_rank) == tp
        assert all(torch.equal(rank[n], t) for rank in per_rank for n, t in adapter.items())
    assert not (tmp_path / "unused").exists()  # nothing written
    with pytest.raises(ValueError, match="weight_sync.lora='files'"):
        AdapterTransport(SPEC, tmp_path, loop, via="files")


def _sglang_lora_cfg(rank: int = 16, **sglang_args: object) -> MilesConfig:
    cfg = MilesConfig()
    cfg.rollout.backend = "sglang"
    cfg.trainer.lora.rank, cfg.trainer.lora.alpha = rank, 2.0 * rank
    cfg.rollout.sglang_args = dict(sglang_args)
    return cfg


def test_sglang_gets_the_trainers_lora_shape() -> None:
    served = with_lora_serving(_sglang_lora_cfg(16))
    argv = sglang_flag_args(served.rollout.sglang_args)
    assert argv.count("--enable-lora") == 1 and argv[argv.index("--max-lora-rank") + 1] == "16"
    i = argv.index("--lora-target-modules")
    assert argv[i + 1:i + 8] == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    # What the user set wins, in either spelling, and is not doubled.
    served = with_lora_serving(_sglang_lora_cfg(16, **{"max-lora-rank": 64, "lora_target_modules": "all",
                                                       "max_loras_per_batch": 4}))
    argv = sglang_flag_args(served.rollout.sglang_args)
    assert argv.count("--max-lora-rank") == 1 and argv[argv.index("--max-lora-rank") + 1] == "64"
    assert argv[argv.index("--lora-target-modules") + 1:][:2] == ["all", "--max-loras-per-batch"]
    validate(_sglang_lora_cfg(16, max_lora_rank=64, lora_target_modules="all"))
    # SGLang stacks q/k/v and gate/up: naming one of a stack covers the others.
    validate(_sglang_lora_cfg(16, lora_target_modules=["q_proj", "o_proj", "gate_up_proj", "down_proj"]))


@pytest.mark.parametrize(("args", "message"), [
    ({"max_lora_rank": 8}, r"rollout.sglang_args.max_lora_rank=8 is below trainer.lora.rank=16.*set it >= 16"),
    ({"enable_lora": False}, r"rollout.sglang_args.enable_lora=False: .*weight_sync.lora=merged"),
    ({"lora_target_modules": ["q_proj", "o_proj"]},
     r"lora_target_modules=\['q_proj', 'o_proj'\] does not cover trainer.lora.targets "
     r"\['gate_proj', 'up_proj', 'down_proj'\]"),
    ({"max_loaded_loras": 1}, r"rollout.sglang_args.max_loaded_loras=1: .*set it >= 2"),
])
def test_sglang_args_contradicting_the_trainers_lora_are_refused(args: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        validate(_sglang_lora_cfg(16, **args))
    cfg = _sglang_lora_cfg(16, **args)
    cfg.weight_sync.lora = "merged"  # merged pushes send plain weights: the engine's LoRA flags are the user's
    validate(cfg)


def test_reference_args_below_the_trainers_rank_are_refused() -> None:
    cfg = MilesConfig()
    cfg.trainer.lora.rank = 8
    cfg.rollout.reference_args = {"max-lora-rank": 4}
    with pytest.raises(ConfigError, match=r"rollout.reference_args.max_lora_rank=4 is below trainer.lora.rank=8"):
        validate(cfg)
