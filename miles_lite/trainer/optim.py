"""Megatron DDP wrapper, optimizer and LR schedule from `TrainerConfig`."""

from __future__ import annotations

from typing import Any

import torch

from miles_lite.config.schema import TrainerConfig
from miles_lite.trainer.model import Runtime

# trainer.lr_schedule -> megatron OptimizerParamScheduler decay style
_DECAY_STYLES = {"constant": "constant", "cosine": "cosine", "linear": "linear"}


def wrap_ddp(model: torch.nn.Module, config: Any, trainer: TrainerConfig, runtime: Runtime) -> Any:
    """Megatron `DistributedDataParallel` around `model`: contiguous fp32 grad buffers, reduced once per step.

    Gradient reduction is triggered explicitly by `finalize_model_grads` after the last micro-batch,
    so ranks may run different numbers of micro-batches.
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    if trainer.offload.optimizer_cpu and runtime.device == "cpu":
        raise ValueError("trainer.offload.optimizer_cpu=true moves the optimizer off the GPU; the trainer runs on "
                         "CPU: set it to false")
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=trainer.use_distributed_optimizer,
        # Non-finite gradients are detected by the trainer, which skips the step instead of raising.
        check_for_nan_in_grad=False,
    )
    return DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)


def build_optimizer(ddp_model: Any, trainer: TrainerConfig, runtime: Runtime) -> Any:
    """Megatron Adam (`get_megatron_optimizer`) with the trainer's LR, betas, eps, weight decay and clipping."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from miles_lite.trainer import cpu_compat

    # Before the optimizer is built: megatron picks its Adam class at construction.
    cpu_compat.use_torch_optimizer_kernels()
    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=trainer.lr,
        min_lr=trainer.min_lr,
        weight_decay=trainer.weight_decay,
        adam_beta1=trainer.adam_beta1,
        adam_beta2=trainer.adam_beta2,
        adam_eps=trainer.adam_eps,
        clip_grad=trainer.clip_grad,
        bf16=runtime.precision != "fp32",
        fp16=False,
        params_dtype=runtime.params_dtype,
        use_distributed_optimizer=trainer.use_distributed_optimizer,
        # Megatron's CPU offload: all of the optimizer state on the host (HybridDeviceOptimizer).
        optimizer_cpu_offload=trainer.offload.optimizer_cpu,
        optimizer_offload_fraction=1.0 if trainer.offload.optimizer_cpu else 0.0,
    )
    return get_megatron_optimizer(opt_config, [ddp_model])


def build_scheduler(optimizer: Any, trainer: TrainerConfig, total_steps: int) -> Any:
    """Megatron `OptimizerParamScheduler`: linear warm-up from 0 over `lr_warmup_steps`, then
    constant / cosine / linear decay to `min_lr` at `lr_decay_steps` (default `total_steps`)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    if trainer.lr_schedule not in _DECAY_STYLES:
        raise ValueError(f"trainer.lr_schedule={trainer.lr_schedule!r} is not one of {', '.join(_DECAY_STYLES)}")
    if trainer.lr_warmup_steps < 0:
        raise ValueError(f"trainer.lr_warmup_steps={trainer.lr_warmup_steps} must be >= 0")
    decay = trainer.lr_decay_steps if trainer.lr_decay_steps is not None else total_steps
    # Megatron requires decay steps > warm-up steps > = 0.
    decay = max(decay, trainer.lr_warmup_steps + 1)
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if trainer.lr_warmup_steps > 0 else trainer.lr,
        max_lr=trainer.lr,
        min_lr=min(trainer.min_lr, trainer.lr),
        lr_warmup_steps=trainer.lr_warmup_steps,
        lr_decay_steps=decay,
        lr_decay_style=_DECAY_STYLES[trainer.lr_schedule],
        start_wd=trainer.weight_decay,
        end_wd=trainer.weight_decay,
        wd_incr_steps=decay,
        wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=False,
        override_opt_param_scheduler=True,
    )


def current_lr(optimizer: Any) -> float:
    """Learning rate of the first parameter group (all groups share it here)."""
    return float(optimizer.param_groups[0]["lr"])


def set_lr(optimizer: Any, lr: float) -> None:
    """Force every parameter group's learning rate (the SFT warm-up uses its own LR)."""
    for group in optimizer.param_groups:
        group["lr"] = lr
