"""RoPE scaling read from HF configs: inverse frequencies and attention factor equal transformers' own."""

from __future__ import annotations

import math

import pytest
import torch

from miles_lite.config.schema import TinyModelShape
from miles_lite.trainer.model import spec_from_hf_config
from miles_lite.trainer.rope import rope_from_hf_config, softmax_scale
from miles_lite.trainer.tiny_hf import tiny_hf_config

LLAMA31 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 8192}
LLAMA32 = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 8192}
TINY_LLAMA3 = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 2.0,
               "original_max_position_embeddings": 16}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
TINY_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 8.0,
             "beta_slow": 0.5}
YARN_MSCALE = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0,
               "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1}


def _hf_rope(arch: str, scaling: dict, theta: float, head_dim: int, max_pos: int) -> tuple[torch.Tensor, float]:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    shape = TinyModelShape(qkv_bias=False, qk_norm=arch == "qwen3", head_dim=head_dim, rope_theta=theta,
                           max_position_embeddings=max_pos, rope_scaling=scaling)
    config = tiny_hf_config(arch, shape, 128)
    inv, factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](config, torch.device("cpu"))
    return inv, float(factor)


@pytest.mark.parametrize(("arch", "scaling", "theta", "head_dim", "max_pos"), [
    ("llama", LLAMA31, 500000.0, 128, 131072), ("llama", LLAMA32, 500000.0, 64, 131072),
    ("llama", TINY_LLAMA3, 10000.0, 16, 128), ("qwen3", YARN, 1e6, 128, 131072),
    ("qwen3", TINY_YARN, 10000.0, 32, 128), ("llama", YARN_MSCALE, 10000.0, 64, 163840),
])
def test_inv_freq_and_attention_factor_equal_transformers(arch: str, scaling: dict, theta: float, head_dim: int,
                                                          max_pos: int) -> None:
    hf_inv, hf_factor = _hf_rope(arch, scaling, theta, head_dim, max_pos)
    config = tiny_hf_config(arch, TinyModelShape(qkv_bias=False, qk_norm=arch == "qwen3", head_dim=head_dim,
                                                 rope_theta=theta, max_position_embeddings=max_pos,
                                                 rope_scaling=scaling), 128)
    spec = spec_from_hf_config(config)
    assert spec.rope.rope_type == scaling["rope_type"] and spec.rope_theta == theta
    assert torch.equal(spec.rope.inv_freq(head_dim), hf_inv)
    assert spec.rope.attention_factor == pytest.approx(hf_factor, rel=1e-12)
    plain = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    assert not torch.equal(hf_inv, plain)  # the scaling really changes frequencies


def test_old_style_rope_scaling_block_and_type_key() -> None:
    cfg = {"rope_theta": 500000.0, "max_position_embeddings": 131072,
           "rope_scaling": {"type": "llama3", **{k: v for k, v in LLAMA31.items() if k != "rope_type"}}}
    rope = rope_from_hf_config(cfg)
    assert (rope.rope_type, rope.factor, rope.original_max_position_embeddings) == ("llama3", 8.0, 8192)
    assert softmax_scale(rope, 128) is None


def test_yarn_attention_factor_becomes_the_softmax_scale() -> None:
    rope = rope_from_hf_config({"rope_theta": 1e6, "rope_scaling": YARN, "max_position_embeddings": 131072})
    assert rope.attention_factor == pytest.approx(0.1 * math.log(4.0) + 1.0)
    assert softmax_scale(rope, 64) == pytest.approx(rope.attention_factor ** 2 / 8.0)


@pytest.mark.parametrize(("scaling", "message"), [
    ({"rope_type": "longrope", "factor": 4.0}, "rope type 'longrope'.*rope_scaling.rope_type"),
    ({"rope_type": "dynamic", "factor": 4.0}, "rope type 'dynamic'"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}, "rope_scaling.high_freq_factor"),
    ({"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0}, "rope_scaling.factor"),
    ({"rope_type": "yarn", "factor": 4.0, "partial_rotary_factor": 0.5}, "partial_rotary_factor"),
])
def test_unsupported_rope_settings_name_the_field(scaling: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        rope_from_hf_config({"rope_theta": 1e4, "rope_scaling": scaling, "max_position_embeddings": 512})


def test_tiny_shape_refuses_a_bad_rope_scaling_by_its_config_name() -> None:
    with pytest.raises(ValueError, match="model.shape.rope_scaling: .*rope type 'su'"):
        tiny_hf_config("llama", TinyModelShape(qkv_bias=False, rope_scaling={"rope_type": "su"}), 64)
