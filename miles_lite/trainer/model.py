"""Megatron-core `GPTModel` built from a Hugging Face config (Qwen2/Qwen2.5, Llama, Qwen3).

The HF config is first read into `HFModelSpec` (the few numbers the two frameworks share); the
Megatron `TransformerConfig` is derived from it plus the trainer's precision/device choices, and
`trainer.transformer` entries pass through verbatim.

Attention layout: on the local (CPU) spec, megatron's `DotProductAttention` rejects packed
sequences (THD), so a micro-batch runs as a right-padded `[B, S]` batch under a causal mask, and
RoPE takes explicit positions through megatron's multimodal-RoPE path with a single section
(`mrope_section=[rot_dim/2, 0, 0]` with identical t/h/w positions is exactly 1-D RoPE; the packed
reference row of the tests needs positions restarting per sequence). On the TE (GPU) spec, packed
rows use THD with `cu_seqlens` and plain RoPE restarts per sequence. Scaled RoPE (llama3, yarn) enters
both paths through the rotary module's inverse frequencies (`rope.py`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from miles_lite.config.schema import TrainerConfig
from miles_lite.trainer.rope import RopeScaling, install_inv_freq, rope_from_hf_config, softmax_scale

ARCHS: tuple[str, ...] = ("qwen2", "llama", "qwen3", "qwen3_moe")


@dataclass(frozen=True)
class HFModelSpec:
    """The architecture numbers shared by an HF decoder config and Megatron's `TransformerConfig`.

    `head_dim` may differ from `hidden_size / num_attention_heads` (Qwen3). `vocab_size` is the HF
    (unpadded) vocabulary.
    """

    arch: str
    vocab_size: int
    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rope: RopeScaling
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    # Mixture of experts (0 experts: dense). `moe_layers[i]` is True where layer i routes to experts.
    num_experts: int = 0
    moe_top_k: int = 0
    moe_ffn_hidden_size: int = 0
    norm_topk_prob: bool = False
    moe_layers: tuple[bool, ...] = ()

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0 and any(self.moe_layers)

    @property
    def moe_layer_ids(self) -> tuple[int, ...]:
        """Indices of the MoE layers (the order of routed-expert ids per token)."""
        return tuple(i for i, moe in enumerate(self.moe_layers) if moe)

    @property
    def rope_theta(self) -> float:
        return self.rope.theta

    @property
    def heads_per_group(self) -> int:
        """Query heads sharing one KV head (GQA group size)."""
        return self.num_attention_heads // self.num_kv_heads


def spec_from_hf_config(config: Any) -> HFModelSpec:
    """Read an HF decoder config: a `transformers.PretrainedConfig`, a dict, or a path to a
    checkpoint directory / config.json. Raises ValueError naming the unsupported field."""
    if isinstance(config, (str, Path)):
        path = Path(config)
        path = path / "config.json" if path.is_dir() else path
        cfg: Mapping[str, Any] = json.loads(path.read_text())
    elif isinstance(config, Mapping):
        cfg = config
    else:
        cfg = config.to_dict()
    model_type = cfg.get("model_type")
    if model_type not in ARCHS:
        raise ValueError(f"config.json model_type={model_type!r} is not supported; supported: {', '.join(ARCHS)}")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json hidden_act={cfg.get('hidden_act')!r}: only silu (SwiGLU) is supported")
    if cfg.get("use_sliding_window"):
        raise ValueError("config.json use_sliding_window=true is not supported; set it to false")
    if cfg.get("mlp_bias"):
        raise ValueError("config.json mlp_bias=true is not supported (Megatron is built with add_bias_linear=False)")
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    num_layers = int(cfg["num_hidden_layers"])
    if model_type == "qwen2":
        qkv_bias = True
    else:
        # Llama/Qwen3 `attention_bias` also adds an o_proj bias, which add_bias_linear=False cannot hold.
        if cfg.get("attention_bias"):
            raise ValueError(f"config.json attention_bias=true is not supported for {model_type}")
        qkv_bias = False
    return HFModelSpec(
        arch=str(model_type),
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        ffn_hidden_size=int(cfg["intermediate_size"]),
        num_layers=num_layers,
        num_attention_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        rope=rope_from_hf_config(cfg),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        **(_moe_fields(cfg, num_layers) if model_type == "qwen3_moe" else {}),
    )


def _moe_fields(cfg: Mapping[str, Any], num_layers: int) -> dict[str, Any]:
    """HFModelSpec's MoE fields of a Qwen3-MoE config (layer i is MoE as in transformers' Qwen3MoeDecoderLayer)."""
    # transformers >= 5 writes `num_local_experts` (num_experts is its alias); released checkpoints `num_experts`.
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    top_k = int(cfg.get("num_experts_per_tok") or 0)
    step = int(cfg["decoder_sparse_step"] if cfg.get("decoder_sparse_step") is not None else 1)
    dense = {int(i) for i in cfg.get("mlp_only_layers") or ()}
    if experts > 0 and not 0 < top_k <= experts:
        raise ValueError(f"config.json num_experts_per_tok={top_k} must be in [1, num_experts={experts}]")
    if step < 1:
        raise ValueError(f"config.json decoder_sparse_step={step} must be >= 1")
    if cfg.get("shared_expert_intermediate_size"):
        raise ValueError("config.json shared_expert_intermediate_size is set: shared experts (Qwen2-MoE) are "
                         "not supported; Qwen3-MoE has none")
    layers = tuple(experts > 0 and i not in dense and (i + 1) % step == 0 for i in range(num_layers))
    return dict(num_experts=experts, moe_top_k=top_k, moe_ffn_hidden_size=int(cfg["moe_intermediate_size"]),
                norm_topk_prob=bool(cfg.get("norm_topk_prob", False)), moe_layers=layers)


@dataclass(frozen=True)
class Runtime:
    """Resolved execution choices: `device` cpu|gpu, `layer_spec` local|te, `precision` fp32|bf16|fp8."""

    device: str
    layer_spec: str
    precision: str
    fp8_recipe: str

    @property
    def params_dtype(self) -> torch.dtype:
        return torch.float32 if self.precision == "fp32" else torch.bfloat16

    @property
    def packed_thd(self) -> bool:
        """True when packed micro-batches use THD + cu_seqlens (TE attention) instead of a 2-D mask."""
        return self.layer_spec == "te"


def resolve_runtime(trainer: TrainerConfig) -> Runtime:
    """Resolve `auto` device/spec choices against this machine; raise on impossible combinations."""
    has_cuda = torch.cuda.is_available()
    device = trainer.device if trainer.device != "auto" else ("gpu" if has_cuda else "cpu")
    if device == "gpu" and not has_cuda:
        raise ValueError("trainer.device=gpu but CUDA is not available; set trainer.device=cpu (or auto)")
    layer_spec = trainer.layer_spec if trainer.layer_spec != "auto" else ("te" if device == "gpu" else "local")
    if layer_spec == "te" and device == "cpu":
        raise ValueError("trainer.layer_spec=te needs a GPU; set trainer.layer_spec=local on CPU")
    if trainer.precision not in ("fp32", "bf16", "fp8"):
        raise ValueError(f"trainer.precision={trainer.precision!r} is not one of fp32, bf16, fp8")
    if trainer.precision == "fp8" and layer_spec != "te":
        raise ValueError("trainer.precision=fp8 needs trainer.layer_spec=te (TransformerEngine on a GPU)")
    return Runtime(device, layer_spec, trainer.precision, trainer.fp8_recipe)


def padded_vocab_size(vocab_size: int, tp: int, divisor: int) -> int:
    """Smallest multiple of `tp * divisor` >= `vocab_size` (rows beyond `vocab_size` are padding)."""
    if divisor < 1:
        raise ValueError(f"trainer.vocab_divisor={divisor} must be >= 1")
    multiple = tp * divisor
    return -(-vocab_size // multiple) * multiple


def _fp8_fields(runtime: Runtime) -> dict[str, Any]:
    """TransformerConfig FP8 fields; megatron builds the TE recipe from them inside each block."""
    if runtime.precision != "fp8":
        return {}
    from miles_lite.trainer.fp8 import check_te_recipe

    check_te_recipe(runtime.fp8_recipe)
    # Float8BlockScaling is E4M3-only; delayed/current scaling use E4M3 forward + E5M2 gradients.
    fmt = "e4m3" if runtime.fp8_recipe == "blockwise" else "hybrid"
    return {"fp8": fmt, "fp8_recipe": runtime.fp8_recipe}


def _passthrough(overrides: Mapping[str, Any]) -> dict[str, Any]:
    from megatron.core.transformer import TransformerConfig

    valid = {f.name for f in dataclasses.fields(TransformerConfig)}
    unknown = sorted(set(overrides) - valid)
    if unknown:
        sample = ", ".join(sorted(n for n in valid if n.startswith(("recompute", "attention", "apply")))[:8])
        raise ValueError(
            f"trainer.transformer has fields TransformerConfig does not know: {unknown}; "
            f"valid fields include {sample}, ... (see megatron.core.transformer.TransformerConfig)"
        )
    return dict(overrides)


def build_transformer_config(spec: HFModelSpec, trainer: TrainerConfig, runtime: Runtime) -> Any:
    """Megatron `TransformerConfig` for `spec` under the trainer's TP/precision choices."""
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(**transformer_fields(spec, trainer, runtime))


def transformer_fields(spec: HFModelSpec, trainer: TrainerConfig, runtime: Runtime) -> dict[str, Any]:
    """The `TransformerConfig` fields of `build_transformer_config`, `trainer.transformer` applied last."""
    cpu = runtime.device == "cpu"
    fields: dict[str, Any] = dict(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        ffn_hidden_size=spec.ffn_hidden_size,
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_kv_heads,
        kv_channels=spec.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=spec.rms_norm_eps,
        add_bias_linear=False,
        add_qkv_bias=spec.qkv_bias,
        gated_linear_unit=True,
        activation_func=F.silu,
        qk_layernorm=spec.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        attention_softmax_in_fp32=True,
        tensor_model_parallel_size=trainer.tp,
        pipeline_model_parallel_size=trainer.pp,
        params_dtype=runtime.params_dtype,
        bf16=runtime.precision != "fp32",
        # Weights always come from an HF state dict; megatron's own init would be overwritten.
        perform_initialization=False,
        use_cpu_initialization=cpu,
        # The fused paths need CUDA kernels or torch.compile; plain torch ops are exact on CPU.
        bias_activation_fusion=not cpu,
        bias_dropout_fusion=not cpu,
        masked_softmax_fusion=not cpu,
        # Packed THD rows: megatron's unfused RoPE splits the row per sequence (a host sync and a dozen
        # small kernels per sequence, for q and k, in every layer and its backward); TransformerEngine's
        # fused kernel takes the row whole, positions restarting per sequence as the unfused path does.
        apply_rope_fusion=runtime.packed_thd,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        # Megatron's default ("full") is deprecated in favour of this equivalent and warns on every start.
        cuda_graph_scope=[],
        # YaRN's attention factor (None for plain RoPE and llama3: megatron's 1/sqrt(head_dim)).
        softmax_scale=softmax_scale(spec.rope, spec.head_dim),
    )
    fields.update(_moe_config(spec, trainer, runtime))
    if runtime.layer_spec == "local":
        # Explicit RoPE positions (see the module docstring).
        fields["mrope_section"] = [spec.head_dim // 2, 0, 0]
    fields.update(_fp8_fields(runtime))
    fields.update(_passthrough(trainer.transformer))
    return fields


def _moe_config(spec: HFModelSpec, trainer: TrainerConfig, runtime: Runtime) -> dict[str, Any]:
    """TransformerConfig MoE fields: Qwen3-MoE's softmax top-k router on megatron's MoE layer."""
    if not spec.is_moe:
        return {}
    cpu = runtime.device == "cpu"
    dispatcher = trainer.moe_token_dispatcher
    if dispatcher == "auto":
        dispatcher = "allgather" if cpu else "alltoall"
    if cpu and dispatcher == "alltoall":
        raise ValueError("trainer.moe_token_dispatcher=alltoall needs CUDA streams; use allgather (or auto) on CPU")
    return dict(
        num_moe_experts=spec.num_experts,
        moe_router_topk=spec.moe_top_k,
        moe_ffn_hidden_size=spec.moe_ffn_hidden_size,
        moe_layer_freq=[1 if moe else 0 for moe in spec.moe_layers],
        moe_router_score_function="softmax",
        # norm_topk_prob: softmax over the k selected logits equals transformers' softmax-topk-renormalise;
        # without it the gates are the full softmax's top-k values (megatron's pre-softmax).
        moe_router_pre_softmax=not spec.norm_topk_prob,
        moe_router_load_balancing_type="aux_loss" if trainer.moe_aux_loss_coef > 0 else "none",
        moe_aux_loss_coeff=trainer.moe_aux_loss_coef,
        moe_z_loss_coeff=trainer.moe_z_loss_coef or None,
        moe_token_dispatcher_type=dispatcher,
        expert_model_parallel_size=trainer.ep,
        expert_tensor_parallel_size=1,
        # TransformerEngine's grouped GEMM on GPU; one plain MLP per expert (SequentialMLP) on CPU.
        moe_grouped_gemm=not cpu,
        moe_permute_fusion=False,
        moe_router_fusion=False,
    )


def _local_block_spec(config: Any, layer_spec: Any) -> Any:
    """The local layer spec as a whole block whose final norm is torch's as well.

    Given a layer spec alone, megatron's `TransformerBlock` picks its final norm by what is installed:
    TransformerEngine's `TENorm` whenever TE imports, which runs on CUDA tensors only, so a CPU run in
    an environment with TE (the GPU image) failed at the last norm.
    """
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    specs = layer_spec if isinstance(layer_spec, list) else [layer_spec] * get_num_layers_to_build(config)
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=WrappedTorchNorm)


def build_gpt_model(spec: HFModelSpec, config: Any, runtime: Runtime, padded_vocab: int) -> torch.nn.Module:
    """An (empty-weight) `GPTModel` for `spec`; load weights with `hf_convert.load_hf_into_model`."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    if runtime.layer_spec == "te" and spec.is_moe:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        layer_spec = get_gpt_decoder_block_spec(config, use_transformer_engine=True, normalization="RMSNorm")
        pos_type = "rope"
    elif runtime.layer_spec == "te":
        layer_spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=spec.qk_norm)
        pos_type = "rope"
    else:
        dense = get_gpt_layer_local_spec(qk_layernorm=spec.qk_norm, normalization="RMSNorm")
        if spec.is_moe:
            moe = get_gpt_layer_local_spec(num_experts=spec.num_experts, moe_grouped_gemm=False,
                                           qk_layernorm=spec.qk_norm, normalization="RMSNorm")
            layer_spec = _local_block_spec(config, [moe if m else dense for m in spec.moe_layers])
        else:
            layer_spec = _local_block_spec(config, dense)
        pos_type = "mrope"
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=padded_vocab,
        max_sequence_length=spec.max_position_embeddings,
        pre_process=True,
        post_process=True,
        parallel_output=True,
        share_embeddings_and_output_weights=spec.tie_word_embeddings,
        position_embedding_type=pos_type,
        rotary_base=spec.rope_theta,
    )
    install_inv_freq(model, spec.rope, spec.head_dim)
    if spec.is_moe:
        from miles_lite.trainer.moe_layer import use_tensor_parallel_moe_layers

        use_tensor_parallel_moe_layers(model)
    if runtime.device == "gpu":
        model = model.cuda()
    return model
