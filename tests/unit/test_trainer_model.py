"""HF config -> model spec, vocabulary padding, runtime resolution and TransformerConfig pass-through."""

from __future__ import annotations

import pytest

from miles_lite.config.schema import TinyModelShape, TrainerConfig
from miles_lite.trainer.model import padded_vocab_size, resolve_runtime, spec_from_hf_config
from miles_lite.trainer.tiny_hf import tiny_hf_config

QWEN25_05B = {
    "model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
    "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936, "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "max_position_embeddings": 32768, "hidden_act": "silu",
    "use_sliding_window": False, "rope_scaling": None,
}


def test_qwen25_config_json() -> None:
    spec = spec_from_hf_config(QWEN25_05B)
    assert (spec.head_dim, spec.num_kv_heads, spec.heads_per_group) == (64, 2, 7)
    assert spec.qkv_bias and not spec.qk_norm and spec.tie_word_embeddings
    assert spec.rope_theta == 1e6
    # Qwen's own padding: 151,936 -> 152,064 rows at tp * 128 = 256.
    assert padded_vocab_size(spec.vocab_size, 2, 128) == 152064


def test_transformers_configs_of_each_arch() -> None:
    qwen3 = spec_from_hf_config(tiny_hf_config("qwen3", TinyModelShape(qkv_bias=False, qk_norm=True, head_dim=32),
                                               512))
    assert (qwen3.head_dim, qwen3.hidden_size // qwen3.num_attention_heads) == (32, 16)
    assert qwen3.qk_norm and not qwen3.qkv_bias
    llama = spec_from_hf_config(tiny_hf_config("llama", TinyModelShape(qkv_bias=False, tie_word_embeddings=False),
                                               256))
    assert not llama.qkv_bias and not llama.tie_word_embeddings and llama.rope_theta == 10000.0


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ({"model_type": "gpt2"}, "model_type"),
        ({"rope_scaling": {"rope_type": "longrope", "factor": 4.0}}, "rope type 'longrope'"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"use_sliding_window": True}, "use_sliding_window"),
    ],
)
def test_unsupported_configs_name_the_field(patch: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        spec_from_hf_config({**QWEN25_05B, **patch})


def test_tiny_shape_must_fit_the_arch() -> None:
    with pytest.raises(ValueError, match="model.shape.qkv_bias=true"):
        tiny_hf_config("qwen2", TinyModelShape(qkv_bias=False), 64)
    with pytest.raises(ValueError, match="model.shape.qk_norm=true"):
        tiny_hf_config("qwen3", TinyModelShape(qkv_bias=False), 64)
    with pytest.raises(ValueError, match="model.shape.qkv_bias=false"):
        tiny_hf_config("llama", TinyModelShape(qkv_bias=True), 64)


def test_runtime_resolution_on_this_machine() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("checks the CPU resolution")
    rt = resolve_runtime(TrainerConfig())
    assert (rt.device, rt.layer_spec, rt.precision, rt.packed_thd) == ("cpu", "local", "fp32", False)
    with pytest.raises(ValueError, match="trainer.device=gpu"):
        resolve_runtime(TrainerConfig(device="gpu"))
    with pytest.raises(ValueError, match="layer_spec=te needs a GPU"):
        resolve_runtime(TrainerConfig(layer_spec="te"))
    with pytest.raises(ValueError, match="precision=fp8"):
        resolve_runtime(TrainerConfig(precision="fp8"))


def test_transformer_passthrough_sets_and_rejects_fields() -> None:
    from miles_lite.trainer.model import build_transformer_config

    spec = spec_from_hf_config(QWEN25_05B)
    trainer = TrainerConfig(transformer={"recompute_granularity": "selective"})
    config = build_transformer_config(spec, trainer, resolve_runtime(TrainerConfig(device="cpu")))
    assert config.recompute_granularity == "selective"
    assert config.num_query_groups == 2 and config.kv_channels == 64 and config.add_qkv_bias
    with pytest.raises(ValueError, match=r"trainer.transformer.*\['recompute_granularty'\].*valid fields include"):
        build_transformer_config(spec, TrainerConfig(transformer={"recompute_granularty": "full"}),
                                 resolve_runtime(TrainerConfig(device="cpu")))


def test_rope_fusion_follows_the_packed_layout_and_yields_to_the_passthrough() -> None:
    # The fields alone: a TE TransformerConfig cannot be built without TransformerEngine.
    from miles_lite.trainer.model import Runtime, transformer_fields

    spec = spec_from_hf_config(QWEN25_05B)
    te = Runtime("gpu", "te", "bf16", "delayed")
    local = Runtime("cpu", "local", "fp32", "delayed")
    assert transformer_fields(spec, TrainerConfig(), te)["apply_rope_fusion"] is True
    fields = transformer_fields(spec, TrainerConfig(), local)
    assert fields["apply_rope_fusion"] is False and fields["mrope_section"] == [32, 0, 0]
    off = TrainerConfig(transformer={"apply_rope_fusion": False})
    assert transformer_fields(spec, off, te)["apply_rope_fusion"] is False


def test_padded_vocab_rejects_bad_divisor() -> None:
    with pytest.raises(ValueError, match="vocab_divisor"):
        padded_vocab_size(100, 1, 0)
    assert padded_vocab_size(500, 1, 128) == 512 and padded_vocab_size(512, 4, 1) == 512


def test_fp8_off_clears_the_field_and_restores_it_even_on_error() -> None:
    from types import SimpleNamespace

    from miles_lite.trainer.fp8 import fp8_off

    config = SimpleNamespace(fp8="hybrid")
    with fp8_off(config):
        assert config.fp8 is None
    assert config.fp8 == "hybrid"
    with pytest.raises(RuntimeError), fp8_off(config):
        raise RuntimeError("forward failed")
    assert config.fp8 == "hybrid"


QWEN3_30B_A3B = {
    "model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
    "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
    "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
    "mlp_only_layers": [], "vocab_size": 151936, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False, "max_position_embeddings": 40960, "hidden_act": "silu", "rope_scaling": None,
    "router_aux_loss_coef": 0.001, "attention_bias": False,
}


def test_qwen3_moe_config_json() -> None:
    spec = spec_from_hf_config(QWEN3_30B_A3B)
    assert (spec.num_experts, spec.moe_top_k, spec.moe_ffn_hidden_size) == (128, 8, 768)
    assert spec.is_moe and spec.norm_topk_prob and spec.qk_norm and spec.moe_layer_ids == tuple(range(48))
    sparse = spec_from_hf_config({**QWEN3_30B_A3B, "num_hidden_layers": 6, "decoder_sparse_step": 2,
                                  "mlp_only_layers": [3]})
    assert sparse.moe_layers == (False, True, False, False, False, True)


def test_tiny_qwen3_moe_config_round_trips_through_transformers() -> None:
    shape = TinyModelShape(qkv_bias=False, qk_norm=True, num_layers=3, num_experts=8, num_experts_per_tok=2,
                           moe_ffn_hidden_size=32, mlp_only_layers=[0], norm_topk_prob=False)
    spec = spec_from_hf_config(tiny_hf_config("qwen3_moe", shape, 128).to_dict())
    assert spec.moe_layers == (False, True, True) and not spec.norm_topk_prob
    assert (spec.num_experts, spec.moe_top_k, spec.moe_ffn_hidden_size) == (8, 2, 32)


@pytest.mark.parametrize(("patch", "message"), [
    ({"num_experts_per_tok": 0}, "num_experts_per_tok"),
    ({"num_experts_per_tok": 129}, "num_experts_per_tok"),
    ({"decoder_sparse_step": 0}, "decoder_sparse_step"),
    ({"shared_expert_intermediate_size": 512}, "shared_expert_intermediate_size"),
])
def test_bad_moe_configs_name_the_field(patch: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        spec_from_hf_config({**QWEN3_30B_A3B, **patch})


def test_tiny_moe_shape_must_fit_the_arch() -> None:
    with pytest.raises(ValueError, match="model.shape.num_experts"):
        tiny_hf_config("qwen3_moe", TinyModelShape(qkv_bias=False, qk_norm=True), 64)
    with pytest.raises(ValueError, match="model.shape.mlp_only_layers"):
        tiny_hf_config("qwen3_moe", TinyModelShape(qkv_bias=False, qk_norm=True, num_experts=4, mlp_only_layers=[7]),
                       64)


def test_checkpoint_state_matches_what_transformers_saves(tmp_path) -> None:
    import torch
    from safetensors.torch import load_file

    from miles_lite.trainer.tiny_hf import build_tiny_hf_model, checkpoint_state

    shape = TinyModelShape(qkv_bias=False, qk_norm=True, num_experts=4, num_experts_per_tok=2, moe_ffn_hidden_size=8,
                           hidden_size=32, ffn_hidden_size=48, tie_word_embeddings=False)
    model = build_tiny_hf_model("qwen3_moe", shape, 64, seed=0)
    model.save_pretrained(str(tmp_path), safe_serialization=True)
    saved = load_file(str(tmp_path / "model.safetensors"))
    mine = checkpoint_state(model)
    assert set(mine) == set(saved)
    assert all(torch.equal(mine[k], saved[k]) for k in saved)
