"""LoRA adapters on megatron-core's fused, tensor-parallel linear layers; the base weights stay frozen.

Why a wrapper of our own: megatron-core 0.16 has no trainable LoRA (only inference-side adapter
bookkeeping), and PEFT's megatron support (`LoraParallelLinear`) adapts a whole layer: it cannot give
`linear_qkv`'s q, k and v, or `linear_fc1`'s gate and up, separate adapters laid out in megatron's
per-KV-group interleaving, which PEFT checkpoints, SGLang and every HF model expect (`q_proj`,
`k_proj`, ... each with its own A and B), and it does not cover TransformerEngine's fused norm+linear.

Each adapted projection (PEFT name) is an A [r, in] and a B [out, r], sharded the way its base
layer is:
- column-parallel base (`linear_qkv`: q/k/v, `linear_fc1`: gate/up): A replicated, B split on its
  output rows like the base's rows. The rank-r activation `A x` enters a copy-to-TP region, so A's
  gradient is summed over the TP ranks (each holds only its rows of B).
- row-parallel base (`linear_proj`: o, `linear_fc2`: down): A split on its input columns like the
  base, B replicated; the partial `A x` is all-reduced (megatron's reduce-from-TP region) before B.
The adapters live in their own module (`LoraAdapters`), added to each base layer's output by a forward
hook, so the model's parameter names, layouts and HF conversion are those of the base. Only the
adapters go into Megatron's DDP and optimizer. On the TransformerEngine spec `linear_qkv` and
`linear_fc1` take the un-normalised input and apply the RMSNorm themselves (`layer_norm_weight`); the
adapter applies the same norm to its own input there.

Dropout masks are drawn at the full (un-sharded) input width from the default generator, which is
seeded alike on every TP rank, so TP=1 and TP=N draw the same masks.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from miles_lite.formats.lora import TARGETS, LoraSpec, tensor_name
from miles_lite.trainer.layout import LayoutKind, ParamLayout
from miles_lite.trainer.model import HFModelSpec

# Megatron module (under decoder.layers.{i}.) -> the PEFT targets it fuses, in fused order.
FUSED: dict[str, tuple[str, ...]] = {
    "self_attention.linear_qkv": ("q_proj", "k_proj", "v_proj"),
    "self_attention.linear_proj": ("o_proj",),
    "mlp.linear_fc1": ("gate_proj", "up_proj"),
    "mlp.linear_fc2": ("down_proj",),
}
ROW_PARALLEL = frozenset({"o_proj", "down_proj"})


def _dims(spec: HFModelSpec, target: str) -> tuple[int, int]:
    """(in, out) features of the HF projection `target`."""
    h, q, kv, ffn = spec.hidden_size, spec.num_attention_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim, \
        spec.ffn_hidden_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, ffn), "up_proj": (h, ffn), "down_proj": (ffn, h)}[target]


class LoraPair(nn.Module):
    """One projection's adapter shard: `lora_A` [r, in_local], `lora_B` [out_local, r]."""

    def __init__(self, a: Tensor, b: Tensor) -> None:
        super().__init__()
        self.lora_A = nn.Parameter(a)
        self.lora_B = nn.Parameter(b)


class LoraAdapters(nn.Module):
    """Every adapter of one trainer rank, hooked into `model`'s layers (see the module docstring).

    Args:
        model: the rank's (unwrapped) `GPTModel`; its parameters are frozen here.
        spec: the HF architecture numbers.
        lora: rank, alpha, dropout, targets.
        tp_rank / tp_size / tp_group: this rank's tensor-parallel coordinates.
        seed: A's initialisation (drawn at full shape, then sliced, so every TP layout starts alike).
    """

    def __init__(self, model: nn.Module, spec: HFModelSpec, lora: LoraSpec, tp_rank: int, tp_size: int,
                 tp_group: Any, seed: int) -> None:
        super().__init__()
        if getattr(model.config, "sequence_parallel", False):
            raise ValueError("trainer.lora with sequence parallelism is not supported; unset "
                             "trainer.transformer.sequence_parallel")
        self.spec, self.lora = spec, lora
        self.tp_rank, self.tp_size, self.tp_group = tp_rank, tp_size, tp_group
        # DDP and finalize_model_grads read the TransformerConfig of the module they wrap.
        self.config = model.config
        self.enabled = True
        dtype = next(model.parameters()).dtype
        device = next(model.parameters()).device
        model.requires_grad_(False)
        self.layers = nn.ModuleList()
        self._hooks: list[Any] = []
        self._base_names = {f"decoder.layers.{i}.{path}.weight": (i, path) for i in range(len(model.decoder.layers))
                            for path, targets in FUSED.items() if any(t in lora.targets for t in targets)}
        for i, layer in enumerate(model.decoder.layers):
            pairs = nn.ModuleDict()
            for target in lora.targets:
                a, b = self._init_pair(i, target, seed, dtype, device)
                pairs[target] = LoraPair(a, b)
            self.layers.append(pairs)
            for path, targets in FUSED.items():
                mine = [t for t in targets if t in lora.targets]
                if mine:
                    try:
                        module = layer.get_submodule(path)
                    except AttributeError:
                        raise ValueError(f"trainer.lora.targets {mine}: layer {i} has no {path} (expert layers are not "
                                         "adapted); target only the attention projections") from None
                    self._hooks.append(module.register_forward_hook(self._hook(i, path, module)))
        embedding = getattr(model, "embedding", None)
        if getattr(model.config, "recompute_granularity", None) == "full" and embedding is not None:
            # Full recompute runs each chunk of layers as one autograd function, whose output needs grad only
            # if an input does; with the whole base frozen none would, and the adapters inside get no grad.
            self._hooks.append(embedding.register_forward_hook(_input_needs_grad))

    # ---- parameters -----------------------------------------------------------------------------

    def _init_pair(self, layer: int, target: str, seed: int, dtype: torch.dtype,
                   device: torch.device) -> tuple[Tensor, Tensor]:
        fan_in, out = _dims(self.spec, target)
        r = self.lora.rank
        gen = torch.Generator().manual_seed(seed * 1_000_003 + layer * 31 + TARGETS.index(target))
        a = torch.empty(r, fan_in)
        # PEFT's default: A ~ kaiming-uniform(a=sqrt(5)), B = 0, so training starts from the base model.
        nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=gen)
        b = torch.zeros(out, r)
        if target in ROW_PARALLEL:
            a = a.chunk(self.tp_size, dim=1)[self.tp_rank]
        else:
            b = b.chunk(self.tp_size, dim=0)[self.tp_rank]
        return a.to(device=device, dtype=dtype).contiguous(), b.to(device=device, dtype=dtype).contiguous()

    def layouts(self) -> dict[str, ParamLayout]:
        """`ParamLayout` of every adapter parameter; its HF name is the PEFT tensor name."""
        out: dict[str, ParamLayout] = {}
        for name, param in self.named_parameters():
            _, layer, target, which = name.split(".")
            fan_in, fan_out = _dims(self.spec, target)
            r = self.lora.rank
            full = (r, fan_in) if which == "lora_A" else (fan_out, r)
            if target in ROW_PARALLEL:
                kind = LayoutKind.ROW_PARALLEL if which == "lora_A" else LayoutKind.REPLICATED
            else:
                kind = LayoutKind.REPLICATED if which == "lora_A" else LayoutKind.COLUMN_PARALLEL
            if self.tp_size == 1:
                kind = LayoutKind.REPLICATED
            partition = {LayoutKind.REPLICATED: None, LayoutKind.ROW_PARALLEL: 1}.get(kind, 0)
            out[name] = ParamLayout(megatron_name=name, kind=kind,
                                    hf_names=(tensor_name(int(layer), target, which[-1]),), hf_shapes=(full,),
                                    full_shape=full, local_shape=tuple(param.shape), partition_dim=partition,
                                    tp_rank=self.tp_rank, tp_size=self.tp_size)
        return out

    # ---- forward --------------------------------------------------------------------------------

    def _hook(self, layer: int, path: str, module: nn.Module) -> Any:
        targets = [t for t in FUSED[path] if t in self.lora.targets]

        def hook(_module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
            if not self.enabled:
                return output
            x = args[0]
            norm_weight = getattr(module, "layer_norm_weight", None)
            if norm_weight is not None:
                # TE's fused norm+linear: the base normalises inside; the adapter sees the same input.
                x = _rms_norm(x, norm_weight, self.config.layernorm_epsilon)
            base = output[0] if isinstance(output, tuple) else output
            if self.training and self.lora.dropout > 0.0:
                # PEFT draws a mask per projection: one delta per target, laid out as the fused layer's rows.
                delta = self._fuse(path, {t: self._delta(layer, t, x) for t in targets})
                out = base + delta.to(base.dtype)
            else:
                out = self._add_fused(layer, path, targets, x, base)
            return (out, *output[1:]) if isinstance(output, tuple) else out

        return hook

    def _add_fused(self, layer: int, path: str, targets: list[str], x: Tensor, base: Tensor) -> Tensor:
        """`base` plus the fused layer's adapters in two GEMMs: x @ [A_q; A_k; A_v]^T, then one GEMM with the
        B's laid out block-diagonally in the fused layer's row order, accumulated into `base` (addmm). Per
        target it would be a delta as wide as each projection's output, then a copy to lay them out and an add:
        at 7B width those passes over the activations cost more than the adapters' own FLOPs."""
        pairs = [self.layers[layer][t] for t in targets]
        a = pairs[0].lora_A if len(pairs) == 1 else torch.cat([p.lora_A for p in pairs])
        z = self._across_tp(x @ a.t(), targets[0] in ROW_PARALLEL)
        r, width = self.lora.rank, len(pairs) * self.lora.rank
        blocks = {t: nn.functional.pad(p.lora_B, (j * r, width - (j + 1) * r)) for j, (t, p) in
                  enumerate(zip(targets, pairs, strict=True))}
        b = fuse_rows(path, blocks, self._local_out, self.spec, self.tp_size, dim=0) * self.lora.scale
        out = torch.addmm(base.reshape(-1, base.shape[-1]), z.reshape(-1, width).to(base.dtype),
                          b.t().to(base.dtype))
        return out.view(base.shape)

    def _dropout(self, x: Tensor, row_parallel: bool) -> Tensor:
        p = self.lora.dropout
        if not self.training or p == 0.0:
            return x
        width = x.shape[-1] * (self.tp_size if row_parallel else 1)
        keep = torch.empty(*x.shape[:-1], width, device=x.device, dtype=x.dtype).bernoulli_(1.0 - p)
        if row_parallel:
            keep = keep.narrow(-1, self.tp_rank * x.shape[-1], x.shape[-1])
        return x * keep / (1.0 - p)

    def _delta(self, layer: int, target: str, x: Tensor) -> Tensor:
        pair = self.layers[layer][target]
        row = target in ROW_PARALLEL
        z = self._across_tp(self._dropout(x, row) @ pair.lora_A.t(), row)
        return (z @ pair.lora_B.t()) * self.lora.scale

    def _across_tp(self, z: Tensor, row_parallel: bool) -> Tensor:
        """The rank-r activation `A x` across TP ranks: summed for a row-parallel base (each rank holds part of
        the input), a copy-to-TP region for a column-parallel one (A's gradient summed in the backward)."""
        if self.tp_size == 1:
            return z
        from megatron.core.tensor_parallel.mappings import (
            copy_to_tensor_model_parallel_region,
            reduce_from_tensor_model_parallel_region,
        )

        return (reduce_from_tensor_model_parallel_region(z, self.tp_group) if row_parallel
                else copy_to_tensor_model_parallel_region(z, self.tp_group))

    def _fuse(self, path: str, deltas: Mapping[str, Tensor]) -> Tensor:
        """The fused layer's local output from per-projection deltas along the last dim (zeros: untargeted)."""
        return fuse_rows(path, deltas, self._local_out, self.spec, self.tp_size, dim=-1)

    def _local_out(self, target: str) -> int:
        _, out = _dims(self.spec, target)
        return out if target in ROW_PARALLEL else out // self.tp_size

    # ---- weights --------------------------------------------------------------------------------

    @torch.no_grad()
    def merged_delta(self, layer: int, path: str) -> Tensor | None:
        """`scale * B @ A` of the fused layer's local shard (its local weight shape), or None when not adapted."""
        targets = [t for t in FUSED[path] if t in self.lora.targets]
        if not targets:
            return None
        deltas = {}
        for t in targets:
            pair = self.layers[layer][t]
            deltas[t] = (pair.lora_B.float() @ pair.lora_A.float()) * self.lora.scale
        return fuse_rows(path, deltas, self._local_out, self.spec, self.tp_size, dim=0)

    def base_names(self) -> dict[str, tuple[int, str]]:
        """Megatron weight name of every adapted base layer -> (layer, fused module path)."""
        return dict(self._base_names)

    @torch.no_grad()
    def merged(self, name: str, base: Tensor) -> Tensor:
        """Base shard `name` plus its adapters' `scale * B @ A` (a new tensor; `base` itself when not adapted)."""
        where = self._base_names.get(name)
        if where is None:
            return base
        delta = self.merged_delta(*where)
        assert delta is not None
        return (base.float() + delta).to(base.dtype)

    @contextlib.contextmanager
    def merged_into(self, model: nn.Module) -> Iterator[None]:
        """Within the block `model`'s adapted weights hold base + adapter; afterwards the exact base again."""
        params = dict(model.named_parameters())
        saved: dict[str, Tensor] = {}
        try:
            with torch.no_grad():
                for name in self.base_names():
                    saved[name] = params[name].detach().clone()
                    params[name].copy_(self.merged(name, saved[name]))
            with self.disabled():
                yield
        finally:
            with torch.no_grad():
                for name, value in saved.items():
                    params[name].copy_(value)

    @contextlib.contextmanager
    def disabled(self) -> Iterator[None]:
        """The base model alone (the KL reference of a LoRA run)."""
        saved, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = saved

    def close(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()


def fuse_rows(path: str, deltas: Mapping[str, Tensor], local_out: Any, spec: HFModelSpec, tp_size: int,
              dim: int) -> Tensor:
    """Lay per-projection tensors (rows along `dim`) out as the fused megatron layer's local rows.

    `linear_qkv` interleaves per KV group [q heads of the group, k, v]; `linear_fc1` is [gate; up].
    Untargeted projections contribute zeros.
    """
    names = FUSED[path]
    some = next(iter(deltas.values()))
    dim = dim % some.dim()

    def part(t: str) -> Tensor:
        if t in deltas:
            return deltas[t]
        shape = list(some.shape)
        shape[dim] = local_out(t)
        return torch.zeros(shape, dtype=some.dtype, device=some.device)

    if path != "self_attention.linear_qkv":
        return torch.cat([part(t) for t in names], dim=dim)
    groups = spec.num_kv_heads // tp_size
    hd = spec.head_dim
    qpg = spec.num_attention_heads // spec.num_kv_heads
    q, k, v = (part(t) for t in names)
    lead, rest = tuple(some.shape[:dim]), tuple(some.shape[dim + 1:])
    q = q.reshape(*lead, groups, qpg * hd, *rest)
    k = k.reshape(*lead, groups, hd, *rest)
    v = v.reshape(*lead, groups, hd, *rest)
    fused = torch.cat([q, k, v], dim=dim + 1)
    return fused.reshape(*lead, groups * (qpg + 2) * hd, *rest)


def _input_needs_grad(_module: nn.Module, _args: tuple[Any, ...], output: Tensor) -> Tensor:
    return output.requires_grad_(True) if torch.is_grad_enabled() and not output.requires_grad else output


def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def lora_spec(cfg: Any) -> LoraSpec | None:
    """The adapter spec of `trainer.lora` (`cfg`), or None when its rank is 0 (full fine-tuning)."""
    if cfg.rank == 0:
        return None
    return LoraSpec(int(cfg.rank), float(cfg.alpha), float(cfg.dropout), tuple(cfg.targets))


def base_reference(model: Any) -> dict[str, Any]:
    """What a LoRA checkpoint names as its base (`model`: the run's `ModelConfig`): the HF directory, or the
    seeded tiny model's recipe."""
    from dataclasses import asdict

    if model.hf_path:
        return {"hf_path": str(model.hf_path)}
    return {"tiny": {"arch": model.arch, "shape": asdict(model.shape), "vocab_size": model.vocab_size}}


def attach_lora(handle: Any, trainer: Any, par: Any) -> LoraAdapters | None:
    """Freeze `handle.model` and hook `trainer.lora`'s adapters into it; None when `trainer.lora.rank` is 0."""
    spec = lora_spec(trainer.lora)
    if spec is None:
        return None
    return LoraAdapters(handle.model, handle.spec, spec, par.tp_rank, par.tp_size, par.tp_group, trainer.seed)
