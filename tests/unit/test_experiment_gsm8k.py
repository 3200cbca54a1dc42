"""The GSM8K / Qwen2.5-0.5B GPU recipe composes, validates, and keeps the worklog's settings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from miles_lite.config import ConfigError, load_config, validate

# The fields of Qwen2.5-0.5B-Instruct's config.json that validation reads.
QWEN_05B = {"architectures": ["Qwen2ForCausalLM"], "hidden_size": 896, "num_attention_heads": 14,
            "num_key_value_heads": 2, "num_hidden_layers": 24, "vocab_size": 151936}


@pytest.fixture
def paths(tmp_path: Path) -> dict[str, str]:
    model = tmp_path / "Qwen2.5-0.5B-Instruct"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(QWEN_05B))
    (model / "tokenizer_config.json").write_text("{}")
    row = {"question": "Tom has 3 apples and buys 4 more. How many?", "answer": "3+4=<<3+4=7>>7\n#### 7"}
    for name in ("train.jsonl", "test.jsonl"):
        (tmp_path / name).write_text(json.dumps(row) + "\n")
    return {"model": str(model), "train": str(tmp_path / "train.jsonl"), "eval": str(tmp_path / "test.jsonl")}


def _overrides(paths: dict[str, str], *extra: str) -> list[str]:
    return ["experiment=gsm8k_qwen2.5_0.5b", f"model.hf_path={paths['model']}",
            f"data.train_path={paths['train']}", f"data.eval_path={paths['eval']}", *extra]


def test_recipe_composes_and_validates(paths: dict[str, str]):
    cfg = load_config(_overrides(paths))
    dims = validate(cfg)
    assert dims is not None and (dims.num_attention_heads, dims.num_kv_heads) == (14, 2)
    assert (cfg.model.name, cfg.model.arch, cfg.model.hf_path) == ("qwen2.5-0.5b", "qwen2", paths["model"])
    assert (cfg.trainer.precision, cfg.trainer.device, cfg.trainer.layer_spec) == ("bf16", "gpu", "te")
    assert (cfg.trainer.lr, cfg.trainer.clip_grad) == (1e-6, 1.0)
    assert cfg.rollout.backend == "sglang" and cfg.rollout.group_size == 8
    assert (cfg.rollout.async_steps, cfg.rollout.max_staleness) == (1, 1)
    assert cfg.rollout.sglang_args["skip_tokenizer_init"] is True  # from rollout=sglang, merged with the recipe's
    assert cfg.data.source == "gsm8k" and cfg.data.presample.enabled and cfg.data.presample.k == 8
    assert cfg.rewards.set == "worklog" and cfg.experiment.name == "gsm8k_qwen2.5_0.5b"
    assert cfg.algo.is_level == "sequence_geomean"


def test_fp8_switch_and_single_gpu_overrides(paths: dict[str, str]):
    cfg = load_config(_overrides(paths, "trainer=gpu_fp8", "trainer.fp8_recipe=blockwise",
                                 "rollout.sglang_args.base_gpu_id=0"))
    validate(cfg)
    assert (cfg.trainer.precision, cfg.trainer.fp8_recipe, cfg.trainer.lr) == ("fp8", "blockwise", 1e-6)
    assert cfg.rollout.sglang_args["base_gpu_id"] == 0


def test_on_one_gpu_the_recipe_hands_the_gpu_over_moving_the_state_only_as_needed(paths: dict[str, str]):
    from miles_lite.config.colocation import hands_off, saves_staged_copies

    cfg = load_config(_overrides(paths, "cluster.placement=colocated", "rollout.async_steps=0",
                                 "rollout.sglang_args.base_gpu_id=0", "rollout.sglang_args.mem_fraction_static=0.3"))
    validate(cfg)
    assert hands_off(cfg) and cfg.trainer.offload.when == "needed"
    assert cfg.trainer.offload.parts() == ("params", "grads", "optimizer")
    assert saves_staged_copies(cfg.cluster, cfg.trainer.offload)  # its saves write what each saving step stages


def test_recipe_rejects_bad_parallelism_naming_the_field(paths: dict[str, str]):
    with pytest.raises(ConfigError, match="trainer.tp=4 must divide the model's 14 attention heads"):
        validate(load_config(_overrides(paths, "trainer.tp=4")))
    with pytest.raises(ConfigError, match="data.train_path"):
        validate(load_config(_overrides(paths, "data.train_path=/nonexistent/train.jsonl")))


def test_checkpoint_without_tokenizer_is_named_at_start(paths: dict[str, str]):
    (Path(paths["model"]) / "tokenizer_config.json").unlink()
    with pytest.raises(ConfigError, match="model.hf_path=.* has no tokenizer .*set model.tokenizer_path"):
        validate(load_config(_overrides(paths)))
    tok = Path(paths["model"]).parent / "tokenizer"
    tok.mkdir()
    (tok / "tokenizer.json").write_text("{}")
    assert validate(load_config(_overrides(paths, f"model.tokenizer_path={tok}"))) is not None
