"""RoPE scaling of HF configs (`rope_type` default, llama3, yarn) for the Megatron model.

megatron-core's own options do not cover these configs exactly: its Llama-3 scaling fixes
`low_freq_factor`/`high_freq_factor`/`original_max_position_embeddings` at Llama 3.1's values, and
its YaRN embedding takes no explicit positions (the local spec feeds positions through the mRoPE
path). So the inverse frequencies are computed here with the same float32 operations as
transformers and installed in the model's rotary module; YaRN's attention factor, which
transformers multiplies into both cos and sin, enters as the softmax scale (`factor**2 / sqrt(d)`),
the same product of query and key.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

ROPE_TYPES: tuple[str, ...] = ("default", "llama3", "yarn")


@dataclass(frozen=True)
class RopeScaling:
    """The RoPE numbers of an HF config. Fields not used by `rope_type` stay None."""

    rope_type: str
    theta: float
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    # llama3
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    # yarn
    beta_fast: float | None = None
    beta_slow: float | None = None
    attention_factor: float = 1.0
    truncate: bool = True

    def inv_freq(self, dim: int) -> Tensor:
        """Inverse frequencies of a rotary dimension `dim` (float32), equal to transformers' bit for bit."""
        base = torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim
        if self.rope_type == "default":
            return 1.0 / (self.theta ** base)
        if self.rope_type == "llama3":
            return self._llama3(1.0 / (self.theta ** base))
        return self._yarn(dim)

    def _llama3(self, inv_freq: Tensor) -> Tensor:
        assert self.factor is not None and self.low_freq_factor is not None and self.high_freq_factor is not None
        old_context_len = self.original_max_position_embeddings
        assert old_context_len is not None
        low_freq_wavelen = old_context_len / self.low_freq_factor
        high_freq_wavelen = old_context_len / self.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are divided by `factor`, short ones kept, the band between interpolated.
        inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / self.factor, inv_freq)
        smooth_factor = (old_context_len / wavelen - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor)
        smoothed = (1 - smooth_factor) * inv_freq_llama / self.factor + smooth_factor * inv_freq_llama
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, inv_freq_llama)

    def _yarn(self, dim: int) -> Tensor:
        assert self.factor is not None and self.original_max_position_embeddings is not None
        beta_fast, beta_slow = self.beta_fast or 32, self.beta_slow or 1
        orig = self.original_max_position_embeddings

        def correction_dim(rotations: float) -> float:
            return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(self.theta))

        low, high = correction_dim(beta_fast), correction_dim(beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # transformers' guard against a zero-width ramp
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        pos_freqs = self.theta ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
        extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (self.factor * pos_freqs)
        extra_factor = 1 - ramp
        return interpolation * (1 - extra_factor) + extrapolation * extra_factor


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _field(block: Mapping[str, Any], key: str, rope_type: str) -> Any:
    if block.get(key) is None:
        raise ValueError(f"config.json rope_scaling.{key} is required for rope_type {rope_type!r}; add it")
    return block[key]


def rope_from_hf_config(cfg: Mapping[str, Any]) -> RopeScaling:
    """The RoPE settings of an HF config dict: `rope_theta` plus `rope_scaling` (transformers < 5) or
    `rope_parameters` (transformers >= 5). Raises ValueError naming the field it cannot take."""
    params = dict(cfg.get("rope_parameters") or {})
    scaling = dict(cfg.get("rope_scaling") or {})
    block = {**params, **scaling}
    if any(isinstance(v, Mapping) for v in block.values()):
        raise ValueError("config.json rope_parameters per layer type is not supported; use one rope_parameters block")
    rope_type = block.get("rope_type", block.get("type")) or "default"
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"config.json rope type {rope_type!r} (rope_scaling.rope_type) is not supported; "
                         f"supported: {', '.join(ROPE_TYPES)}")
    theta = cfg.get("rope_theta", block.get("rope_theta"))
    if theta is None:
        raise ValueError("config.json has neither rope_theta nor rope_parameters.rope_theta")
    partial = block.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise ValueError(f"config.json partial_rotary_factor={partial} is not supported; only 1.0 (full rotary)")
    if rope_type == "default":
        return RopeScaling("default", float(theta))
    # Phi-3 style configs keep the pretraining length outside the block and win (as in transformers).
    orig = cfg.get("original_max_position_embeddings") or block.get("original_max_position_embeddings") \
        or cfg.get("max_position_embeddings")
    if orig is None:
        raise ValueError(f"config.json rope_scaling.original_max_position_embeddings is required for {rope_type!r}")
    if rope_type == "llama3":
        low, high = float(_field(block, "low_freq_factor", rope_type)), float(_field(block, "high_freq_factor",
                                                                                       rope_type))
        if high <= low:
            raise ValueError(f"config.json rope_scaling.high_freq_factor={high} must exceed low_freq_factor={low}")
        return RopeScaling("llama3", float(theta), factor=float(_field(block, "factor", rope_type)),
                           original_max_position_embeddings=int(orig), low_freq_factor=low, high_freq_factor=high)
    factor = block.get("factor")
    if factor is None:  # DeepSeek-V3 style: the ratio of the two lengths
        factor = float(cfg["max_position_embeddings"]) / float(orig)
    factor = float(factor)
    attention_factor = block.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = block.get("mscale"), block.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    return RopeScaling("yarn", float(theta), factor=factor, original_max_position_embeddings=int(orig),
                       beta_fast=block.get("beta_fast"), beta_slow=block.get("beta_slow"),
                       attention_factor=float(attention_factor), truncate=bool(block.get("truncate", True)))


def install_inv_freq(model: torch.nn.Module, rope: RopeScaling, head_dim: int) -> None:
    """Put `rope`'s inverse frequencies into a built `GPTModel`'s rotary module (before its first forward:
    megatron caches the embeddings of the plain RoPE module per length)."""
    if rope.rope_type == "default":
        return
    module = getattr(model, "rotary_pos_emb", None)
    if module is None or not hasattr(module, "inv_freq"):
        raise RuntimeError(f"the Megatron model has no rotary module to take rope_type {rope.rope_type!r}")
    module.inv_freq = rope.inv_freq(head_dim).to(module.inv_freq.device)


def softmax_scale(rope: RopeScaling, head_dim: int) -> float | None:
    """The attention softmax scale that carries YaRN's attention factor (None: megatron's 1/sqrt(d))."""
    if rope.attention_factor == 1.0:
        return None
    return rope.attention_factor ** 2 / math.sqrt(head_dim)
