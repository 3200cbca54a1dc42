"""Tiny randomly initialised HF models (Qwen2, Llama, Qwen3, Qwen3-MoE) of a `TinyModelShape`.

The embedded default run and the tests start from these: the trainer converts them like any
real checkpoint, so a laptop run exercises exactly the code path of a Qwen2.5-0.5B run.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from miles_lite.config.schema import TinyModelShape

# Qwen2.5-0.5B's architecture (24 layers, hidden 896, 14 heads / 2 KV groups, SwiGLU 4864, tied
# embeddings, QKV bias): GPU benchmarks and tests build random models of this shape.
QWEN25_05B_SHAPE = TinyModelShape(hidden_size=896, ffn_hidden_size=4864, num_layers=24, num_attention_heads=14,
                                  num_kv_heads=2, max_position_embeddings=32768, rope_theta=1_000_000.0,
                                  rms_norm_eps=1e-6, tie_word_embeddings=True, qkv_bias=True)
QWEN25_VOCAB = 151936


def tiny_hf_config(arch: str, shape: TinyModelShape, vocab_size: int, init_std: float | None = None) -> Any:
    """The transformers config (`Qwen2Config` / `LlamaConfig` / `Qwen3Config`) for `shape`.

    Raises ValueError when `shape` asks for something `arch` cannot express (the field and the fix).
    """
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    common: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.ffn_hidden_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_kv_heads,
        max_position_embeddings=shape.max_position_embeddings,
        rms_norm_eps=shape.rms_norm_eps,
        tie_word_embeddings=shape.tie_word_embeddings,
        rope_theta=shape.rope_theta,
        hidden_act="silu",
    )
    if init_std is not None:
        common["initializer_range"] = init_std
    if shape.rope_scaling:
        from miles_lite.trainer.rope import rope_from_hf_config

        scaling = dict(shape.rope_scaling)
        # Early, with the field's config name: transformers would only warn or fail deep inside.
        try:
            rope_from_hf_config({"rope_theta": shape.rope_theta, "rope_scaling": scaling,
                                 "max_position_embeddings": shape.max_position_embeddings})
        except ValueError as exc:
            raise ValueError(f"model.shape.rope_scaling: {exc}") from exc
        common["rope_scaling"] = scaling
    if arch == "qwen2":
        if not shape.qkv_bias or shape.qk_norm:
            raise ValueError("model.arch=qwen2 has QKV bias and no QK-norm: set model.shape.qkv_bias=true, "
                             "model.shape.qk_norm=false")
        if shape.head_dim not in (None, shape.hidden_size // shape.num_attention_heads):
            raise ValueError(
                "model.arch=qwen2 derives head_dim from hidden_size / heads: set model.shape.head_dim=null"
            )
        return Qwen2Config(**common, use_sliding_window=False)
    if shape.qkv_bias:
        raise ValueError(f"model.arch={arch} has no QKV bias: set model.shape.qkv_bias=false")
    if arch == "llama":
        if shape.qk_norm:
            raise ValueError("model.arch=llama has no QK-norm: set model.shape.qk_norm=false")
        head_dim = shape.head_dim or shape.hidden_size // shape.num_attention_heads
        return LlamaConfig(**common, head_dim=head_dim, attention_bias=False, mlp_bias=False)
    if arch == "qwen3":
        if not shape.qk_norm:
            raise ValueError("model.arch=qwen3 always has QK-norm: set model.shape.qk_norm=true")
        head_dim = shape.head_dim or shape.hidden_size // shape.num_attention_heads
        return Qwen3Config(**common, head_dim=head_dim, attention_bias=False, use_sliding_window=False)
    if arch == "qwen3_moe":
        if not shape.qk_norm:
            raise ValueError("model.arch=qwen3_moe always has QK-norm: set model.shape.qk_norm=true")
        if shape.num_experts < 1 or not 1 <= shape.num_experts_per_tok <= shape.num_experts:
            raise ValueError(f"model.arch=qwen3_moe needs model.shape.num_experts >= 1 (got {shape.num_experts}) "
                             f"and 1 <= model.shape.num_experts_per_tok <= num_experts "
                             f"(got {shape.num_experts_per_tok})")
        bad = [i for i in shape.mlp_only_layers if not 0 <= i < shape.num_layers]
        if bad:
            raise ValueError(f"model.shape.mlp_only_layers={list(shape.mlp_only_layers)} names layers outside "
                             f"[0, {shape.num_layers})")
        head_dim = shape.head_dim or shape.hidden_size // shape.num_attention_heads
        return Qwen3MoeConfig(**common, head_dim=head_dim, attention_bias=False, use_sliding_window=False,
                              num_experts=shape.num_experts, num_experts_per_tok=shape.num_experts_per_tok,
                              moe_intermediate_size=shape.moe_ffn_hidden_size, norm_topk_prob=shape.norm_topk_prob,
                              decoder_sparse_step=shape.decoder_sparse_step,
                              mlp_only_layers=list(shape.mlp_only_layers))
    raise ValueError(f"model.arch={arch!r} is not one of qwen2, llama, qwen3, qwen3_moe")


def build_tiny_hf_model(
    arch: str, shape: TinyModelShape, vocab_size: int, seed: int, init_std: float | None = None
) -> Any:
    """A randomly initialised `*ForCausalLM` in fp32 (same seed -> same weights, on any process)."""
    from transformers import AutoModelForCausalLM

    config = tiny_hf_config(arch, shape, vocab_size, init_std)
    fork_devices: list[int] = []
    with torch.random.fork_rng(devices=fork_devices):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def make_tiny_hf_model(
    arch: str, shape: TinyModelShape, vocab_size: int, out_dir: str | Path, seed: int, init_std: float | None = None
) -> Path:
    """Build a tiny random HF model and save it as an HF safetensors directory; returns `out_dir`.

    Args:
        arch: qwen2 | llama | qwen3.
        shape: layer/width/head counts (`model.shape`).
        vocab_size: vocabulary rows (unpadded).
        out_dir: directory to write `config.json` + `model.safetensors` into.
        seed: weight-init seed.
        init_std: normal-init standard deviation (None: transformers' default 0.02).
    """
    model = build_tiny_hf_model(arch, shape, vocab_size, seed, init_std)
    out = Path(out_dir)
    model.save_pretrained(str(out), safe_serialization=True)
    return out


_FUSED_EXPERTS = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def checkpoint_state(model: Any) -> dict[str, Tensor]:
    """The model's tensors under the names and shapes its safetensors checkpoint holds.

    transformers keeps a Qwen3-MoE layer's experts as two stacked tensors in memory (`experts.gate_up_proj`
    [E, 2F, H], `experts.down_proj` [E, H, F]) but saves and loads one `experts.{e}.{gate,up,down}_proj.weight`
    per expert; the trainer reads the checkpoint names.
    """
    out: dict[str, Tensor] = {}
    for name, tensor in model.state_dict().items():
        match = _FUSED_EXPERTS.match(name)
        if match is None:
            out[name] = tensor
            continue
        prefix, kind = match.groups()
        for e in range(tensor.shape[0]):
            if kind == "down_proj":
                out[f"{prefix}.{e}.down_proj.weight"] = tensor[e]
            else:
                gate, up = tensor[e].chunk(2, dim=0)
                out[f"{prefix}.{e}.gate_proj.weight"], out[f"{prefix}.{e}.up_proj.weight"] = gate, up
    return out
