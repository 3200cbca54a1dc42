"""Hugging Face safetensors <-> tensor-parallel Megatron `GPTModel` weights (bit-exact both ways).

Names follow megatron-core's GPT layer specs: the local spec keeps `input_layernorm` /
`pre_mlp_layernorm` as modules, the TransformerEngine spec fuses them into `linear_qkv` /
`linear_fc1` as `layer_norm_weight`; both map to the same HF norms. With tied embeddings the model
has no `output_layer.weight` and the HF `lm_head.weight` (if the checkpoint carries one) is ignored.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from miles_lite.trainer.layout import LayoutKind, ParamLayout, merge_shards
from miles_lite.trainer.model import HFModelSpec

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
# Routed experts: one MLP per local expert (local spec, SequentialMLP) or TE's grouped GEMM weights.
_EXPERT = re.compile(r"^mlp\.experts\.(?:local_experts\.(\d+)\.(linear_fc[12])\.weight|(linear_fc[12])\.weight(\d+))$")

# Megatron per-layer suffix -> (kind, HF suffixes under model.layers.{i}.)
_LAYER_MAP: dict[str, tuple[LayoutKind, tuple[str, ...]]] = {
    "input_layernorm.weight": (LayoutKind.REPLICATED, ("input_layernorm.weight",)),
    "self_attention.linear_qkv.layer_norm_weight": (LayoutKind.REPLICATED, ("input_layernorm.weight",)),
    "self_attention.linear_qkv.weight": (
        LayoutKind.QKV_FUSED, ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")),
    "self_attention.linear_qkv.bias": (
        LayoutKind.QKV_FUSED, ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")),
    "self_attention.q_layernorm.weight": (LayoutKind.REPLICATED, ("self_attn.q_norm.weight",)),
    "self_attention.k_layernorm.weight": (LayoutKind.REPLICATED, ("self_attn.k_norm.weight",)),
    "self_attention.linear_proj.weight": (LayoutKind.ROW_PARALLEL, ("self_attn.o_proj.weight",)),
    "pre_mlp_layernorm.weight": (LayoutKind.REPLICATED, ("post_attention_layernorm.weight",)),
    "mlp.linear_fc1.layer_norm_weight": (LayoutKind.REPLICATED, ("post_attention_layernorm.weight",)),
    "mlp.linear_fc1.weight": (LayoutKind.GATE_UP_FUSED, ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
    "mlp.linear_fc2.weight": (LayoutKind.ROW_PARALLEL, ("mlp.down_proj.weight",)),
    # MoE router: every rank holds all experts' rows.
    "mlp.router.weight": (LayoutKind.REPLICATED, ("mlp.gate.weight",)),
}

_TOP_MAP: dict[str, tuple[LayoutKind, tuple[str, ...]]] = {
    "embedding.word_embeddings.weight": (LayoutKind.VOCAB_PADDED, ("model.embed_tokens.weight",)),
    "output_layer.weight": (LayoutKind.VOCAB_PADDED, ("lm_head.weight",)),
    "decoder.final_layernorm.weight": (LayoutKind.REPLICATED, ("model.norm.weight",)),
}


def _hf_shape(hf_name: str, spec: HFModelSpec) -> tuple[int, ...]:
    h, hd = spec.hidden_size, spec.head_dim
    q_out, kv_out = spec.num_attention_heads * hd, spec.num_kv_heads * hd
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (spec.vocab_size, h), "lm_head.weight": (spec.vocab_size, h),
        "model.norm.weight": (h,), "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (q_out, h), "self_attn.k_proj.weight": (kv_out, h),
        "self_attn.v_proj.weight": (kv_out, h), "self_attn.q_proj.bias": (q_out,),
        "self_attn.k_proj.bias": (kv_out,), "self_attn.v_proj.bias": (kv_out,),
        "self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,),
        "self_attn.o_proj.weight": (h, q_out), "mlp.gate_proj.weight": (spec.ffn_hidden_size, h),
        "mlp.up_proj.weight": (spec.ffn_hidden_size, h), "mlp.down_proj.weight": (h, spec.ffn_hidden_size),
    }
    key = hf_name if hf_name in shapes else hf_name.split(".", 3)[-1]
    expert = re.match(r"^mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj)\.weight$", key)
    if expert:
        f = spec.moe_ffn_hidden_size
        return (h, f) if expert.group(1) == "down_proj" else (f, h)
    if key == "mlp.gate.weight":
        return (spec.num_experts, h)
    return shapes[key]


def _expert_layout(name: str, layer: str, match: re.Match[str], local_shape: tuple[int, ...], spec: HFModelSpec,
                   ep_rank: int, ep_size: int) -> ParamLayout:
    """Layout of one routed expert's fc1/fc2: whole on its rank (expert TP 1); local expert j of EP rank r
    is global expert r * num_experts / ep + j."""
    local_idx = int(match.group(1) if match.group(1) is not None else match.group(4))
    fc = match.group(2) or match.group(3)
    expert = ep_rank * (spec.num_experts // ep_size) + local_idx
    prefix = f"model.layers.{layer}.mlp.experts.{expert}."
    if fc == "linear_fc1":
        kind, hf_names = LayoutKind.GATE_UP_FUSED, (prefix + "gate_proj.weight", prefix + "up_proj.weight")
    else:
        kind, hf_names = LayoutKind.REPLICATED, (prefix + "down_proj.weight",)
    return ParamLayout(megatron_name=name, kind=kind, hf_names=hf_names,
                       hf_shapes=tuple(_hf_shape(n, spec) for n in hf_names), full_shape=tuple(local_shape),
                       local_shape=tuple(local_shape), partition_dim=0 if kind is LayoutKind.GATE_UP_FUSED else None,
                       tp_rank=0, tp_size=1, expert=expert)


def layout_for(
    name: str, local_shape: tuple[int, ...], spec: HFModelSpec, tp_rank: int, tp_size: int, padded_vocab: int,
    ep_rank: int = 0, ep_size: int = 1,
) -> ParamLayout:
    """The `ParamLayout` of Megatron parameter `name` (shard shape `local_shape`) on TP rank `tp_rank`
    (and, for routed experts, EP rank `ep_rank`)."""
    match = _LAYER.match(name)
    if match:
        layer, suffix = match.groups()
        expert = _EXPERT.match(suffix)
        if expert:
            return _expert_layout(name, layer, expert, local_shape, spec, ep_rank, ep_size)
        if suffix not in _LAYER_MAP:
            raise KeyError(f"no HF mapping for Megatron parameter {name!r}")
        kind, hf_suffixes = _LAYER_MAP[suffix]
        hf_names = tuple(f"model.layers.{layer}.{s}" for s in hf_suffixes)
    elif name in _TOP_MAP:
        kind, hf_names = _TOP_MAP[name]
    else:
        raise KeyError(f"no HF mapping for Megatron parameter {name!r}")
    partition_dim = {LayoutKind.REPLICATED: None, LayoutKind.ROW_PARALLEL: 1}.get(kind, 0)
    full = list(local_shape)
    if partition_dim is not None:
        full[partition_dim] *= tp_size
    qkv = kind is LayoutKind.QKV_FUSED
    vocab = kind is LayoutKind.VOCAB_PADDED
    return ParamLayout(
        megatron_name=name, kind=kind, hf_names=hf_names,
        hf_shapes=tuple(_hf_shape(n, spec) for n in hf_names),
        full_shape=tuple(full), local_shape=tuple(local_shape), partition_dim=partition_dim,
        tp_rank=tp_rank, tp_size=tp_size,
        num_heads=spec.num_attention_heads if qkv else None, num_kv_heads=spec.num_kv_heads if qkv else None,
        head_dim=spec.head_dim if qkv else None,
        vocab_size=spec.vocab_size if vocab else None, padded_vocab_size=padded_vocab if vocab else None,
    )


def model_layouts(
    model: torch.nn.Module, spec: HFModelSpec, tp_rank: int, tp_size: int, padded_vocab: int,
    ep_rank: int = 0, ep_size: int = 1,
) -> dict[str, ParamLayout]:
    """`ParamLayout` of every parameter of an (unwrapped) `GPTModel`, keyed by Megatron name."""
    return {
        name: layout_for(name, tuple(p.shape), spec, tp_rank, tp_size, padded_vocab, ep_rank, ep_size)
        for name, p in model.named_parameters()
    }


def mark_tensor_parallel(model: torch.nn.Module, layouts: Mapping[str, ParamLayout]) -> None:
    """Give every TP-split parameter megatron's `tensor_model_parallel` / `partition_dim` attributes.

    Why: megatron's linear layers only set them inside their weight initialisers, which are skipped
    when weights come from a checkpoint (`perform_initialization=False`). Without them the grad
    norm counts a split weight only on TP rank 0, so clipping and the reported norm are wrong.
    """
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    for name, param in model.named_parameters():
        layout = layouts[name]
        dim = layout.partition_dim
        if layout.expert is not None:
            # Routed experts are split by expert-TP (size 1 here), and megatron marks them parallel as its
            # initialisers would; unmarked, TP rank 1 would leave its experts out of the grad norm.
            dim = 0 if layout.kind is LayoutKind.GATE_UP_FUSED else 1
        if dim is None or getattr(param, "tensor_model_parallel", False):
            continue
        for attr in ("tensor_model_parallel", "partition_dim", "partition_stride"):
            if hasattr(param, attr):
                delattr(param, attr)
        set_tensor_model_parallel_attributes(param, is_parallel=True, dim=dim, stride=1)


def read_hf_state(path: str | Path, names: Iterable[str] | None = None) -> dict[str, Tensor]:
    """Tensors of an HF safetensors checkpoint directory (single file or sharded with an index).

    Args:
        path: directory holding `model.safetensors` or `model.safetensors.index.json` + shards.
        names: only these tensors (None: all).
    """
    root = Path(path)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
    elif (root / "model.safetensors").is_file():
        with safe_open(str(root / "model.safetensors"), framework="pt") as f:
            weight_map = {k: "model.safetensors" for k in f.keys()}  # noqa: SIM118 - safe_open has no iterator
    else:
        raise FileNotFoundError(f"{root} has neither model.safetensors nor model.safetensors.index.json")
    wanted = set(weight_map) if names is None else set(names)
    by_file: dict[str, list[str]] = {}
    for name in wanted:
        if name in weight_map:
            by_file.setdefault(weight_map[name], []).append(name)
    out: dict[str, Tensor] = {}
    for fname, keys in by_file.items():
        with safe_open(str(root / fname), framework="pt") as f:
            for key in keys:
                out[key] = f.get_tensor(key)
    return out


def hf_to_megatron(hf_state: Mapping[str, Tensor], layouts: Mapping[str, ParamLayout]) -> dict[str, Tensor]:
    """This rank's Megatron shards from full HF tensors (dtype kept; padding rows zero)."""
    return {name: layout.assemble(hf_state) for name, layout in layouts.items()}


@torch.no_grad()
def load_hf_into_model(
    model: torch.nn.Module, hf_state: Mapping[str, Tensor], layouts: Mapping[str, ParamLayout]
) -> None:
    """Copy HF weights into the model's parameters in place (cast to each parameter's dtype)."""
    params = dict(model.named_parameters())
    for name, layout in layouts.items():
        params[name].copy_(layout.assemble(hf_state).to(params[name].dtype))


def megatron_to_hf(per_rank: Iterable[Iterable[tuple[ParamLayout, Tensor]]]) -> dict[str, Tensor]:
    """Full HF state dict from every TP rank's `(layout, shard)` pairs (outer iterable = ranks)."""
    grouped: dict[str, tuple[list[ParamLayout], list[Tensor]]] = {}
    for rank_items in per_rank:
        for layout, shard in rank_items:
            lays, tens = grouped.setdefault(layout.megatron_name, ([], []))
            lays.append(layout)
            tens.append(shard)
    out: dict[str, Tensor] = {}
    for lays, tens in grouped.values():
        out.update(merge_shards(lays, tens))
    return out


def expert_on_rank(layout: ParamLayout, ep_rank: int, ep_size: int, num_experts: int) -> ParamLayout:
    """The layout the same Megatron expert parameter has on expert-parallel rank `ep_rank`."""
    from dataclasses import replace

    assert layout.expert is not None
    per_rank = num_experts // ep_size
    expert = ep_rank * per_rank + layout.expert % per_rank
    names = tuple(re.sub(r"\.experts\.\d+\.", f".experts.{expert}.", n) for n in layout.hf_names)
    return replace(layout, hf_names=names, expert=expert)


@torch.no_grad()
def gather_hf_state(
    model: torch.nn.Module, layouts: Mapping[str, ParamLayout], tp_group: dist.ProcessGroup | None,
    ep_group: dist.ProcessGroup | None = None, num_experts: int = 0,
) -> dict[str, Tensor]:
    """All-gather every parameter over the TP group (routed experts over the EP group) and merge into
    full HF tensors (on CPU).

    Every rank receives the full state (tensors of the HF shapes, the parameters' dtype).
    """
    out: dict[str, Tensor] = {}
    for part in iter_hf_state(model, layouts, tp_group, ep_group, num_experts):
        out.update(part)
    return out


def iter_hf_state(
    model: torch.nn.Module, layouts: Mapping[str, ParamLayout], tp_group: dist.ProcessGroup | None,
    ep_group: dist.ProcessGroup | None = None, num_experts: int = 0,
) -> Iterator[dict[str, Tensor]]:
    """`gather_hf_state` one parameter at a time (its HF tensors), so only one is held in full at once.

    Every rank must consume the whole iterator (each parameter is a collective).
    """
    tp_size = dist.get_world_size(tp_group) if tp_group is not None else 1
    ep_size = dist.get_world_size(ep_group) if ep_group is not None else 1
    for name, param in model.named_parameters():
        layout = layouts[name]
        local = param.detach()
        if layout.expert is not None:
            if ep_size == 1:
                yield merge_shards([layout], [local.cpu()])
                continue
            shards = [torch.empty_like(local) for _ in range(ep_size)]
            dist.all_gather(shards, local.contiguous(), group=ep_group)
            part: dict[str, Tensor] = {}
            for r, shard in enumerate(shards):
                part.update(merge_shards([expert_on_rank(layout, r, ep_size, num_experts)], [shard.cpu()]))
            yield part
            continue
        if layout.kind is LayoutKind.REPLICATED or tp_size == 1:
            shards = [local]
            lays = [layout]
        else:
            shards = [torch.empty_like(local) for _ in range(tp_size)]
            dist.all_gather(shards, local.contiguous(), group=tp_group)
            lays = [_with_rank(layout, r) for r in range(tp_size)]
        yield merge_shards(lays, [s.cpu() for s in shards])


def tensor_sha256(tensor: Tensor) -> str:
    """SHA-256 of a tensor's bytes (dtype and shape are the caller's to record): equal digests, equal bits."""
    import hashlib

    raw = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8)
    return hashlib.sha256(raw.numpy()).hexdigest()


def _with_rank(layout: ParamLayout, rank: int) -> ParamLayout:
    from dataclasses import replace

    return replace(layout, tp_rank=rank)


def save_hf_checkpoint(state: Mapping[str, Tensor], hf_config: Mapping[str, object], out_dir: str | Path) -> Path:
    """Write `state` as `model.safetensors` plus `config.json` (an HF directory loadable by transformers)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(dict(hf_config), indent=2, default=str))
    return out
