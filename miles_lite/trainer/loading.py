"""Where the trainer's weights come from: an HF checkpoint directory or a tiny random HF model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from torch import Tensor

from miles_lite.config.schema import ModelConfig, TrainerConfig
from miles_lite.trainer.forward import ModelHandle
from miles_lite.trainer.hf_convert import load_hf_into_model, mark_tensor_parallel, model_layouts, read_hf_state
from miles_lite.trainer.layout import ParamLayout
from miles_lite.trainer.model import (
    HFModelSpec,
    Runtime,
    build_gpt_model,
    build_transformer_config,
    padded_vocab_size,
    spec_from_hf_config,
)
from miles_lite.trainer.parallel import ParallelInfo
from miles_lite.trainer.tiny_hf import build_tiny_hf_model, checkpoint_state


def _from_dir(path: str, field: str) -> tuple[HFModelSpec, dict[str, Tensor], dict[str, Any]]:
    root = Path(path)
    if not (root / "config.json").is_file():
        raise FileNotFoundError(f"{field}={path!r} has no config.json; point it at an HF checkpoint directory")
    config = json.loads((root / "config.json").read_text())
    return spec_from_hf_config(config), read_hf_state(root), config


def load_policy_source(model_cfg: ModelConfig) -> tuple[HFModelSpec, dict[str, Tensor], dict[str, Any]]:
    """`(spec, full HF tensors, config.json dict)` of `model.hf_path`, or of a tiny random model of
    `model.arch` / `model.shape` / `model.vocab_size` seeded by `model.shape.init_seed` (the same on
    every rank)."""
    if model_cfg.hf_path:
        return _from_dir(model_cfg.hf_path, "model.hf_path")
    model = build_tiny_hf_model(model_cfg.arch, model_cfg.shape, model_cfg.vocab_size, model_cfg.shape.init_seed)
    config = model.config.to_dict()
    return spec_from_hf_config(config), checkpoint_state(model), config


def load_teacher_source(teacher_path: str | None) -> tuple[HFModelSpec, dict[str, Tensor]] | None:
    """The teacher of on-policy distillation (`experiment.teacher_path`), or None when unset."""
    if not teacher_path:
        return None
    spec, state, _ = _from_dir(teacher_path, "experiment.teacher_path")
    return spec, state


def build_handle(
    spec: HFModelSpec, hf_state: dict[str, Tensor], trainer: TrainerConfig, runtime: Runtime, par: ParallelInfo
) -> tuple[ModelHandle, dict[str, ParamLayout]]:
    """Build this rank's `GPTModel` shard for `spec`, load `hf_state` into it, and describe its layout."""
    if spec.is_moe and spec.num_experts % par.ep_size:
        raise ValueError(f"trainer.ep={par.ep_size} must divide the model's num_experts={spec.num_experts}")
    if not spec.is_moe and par.ep_size > 1:
        raise ValueError(f"trainer.ep={par.ep_size} needs a mixture-of-experts model; {spec.arch} is dense: "
                         "set trainer.ep=1")
    config = build_transformer_config(spec, trainer, runtime)
    padded = padded_vocab_size(spec.vocab_size, par.tp_size, trainer.vocab_divisor)
    model = build_gpt_model(spec, config, runtime, padded)
    layouts = model_layouts(model, spec, par.tp_rank, par.tp_size, padded, par.ep_rank, par.ep_size)
    mark_tensor_parallel(model, layouts)
    load_hf_into_model(model, hf_state, layouts)
    handle = ModelHandle(model=model, spec=spec, runtime=runtime, padded_vocab=padded, tp_rank=par.tp_rank,
                         tp_group=par.tp_group)
    return handle, layouts
