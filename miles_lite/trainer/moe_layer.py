"""megatron-core's MoE layer under tensor parallelism without sequence parallelism.

The trainer runs no sequence parallelism (its local spec cannot: torch's norms refuse it), and
megatron's `MoELayer` refuses to train under TP > 1 without it, for speed alone: every TP rank then
hands the same tokens to the dispatcher, which gathers over TP x EP, so each expert computes each
token once per TP rank. Outputs stay exact (each rank's slice comes back to it alone); only a routed
expert's gradient collects one copy per TP rank, which `expert_parallel.scale_expert_grads` divides out.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.transformer.moe.moe_layer import MoELayer


class TensorParallelMoELayer(MoELayer):
    """`MoELayer` that trains under TP without sequence parallelism (see the module docstring)."""

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if not (self.training and self.attn_tp_group.size() > 1 and not self.config.sequence_parallel):
            return super().forward(hidden_states, *args, **kwargs)
        # The only use of `training` in MoELayer.forward is that refusal; the router keeps its own flag.
        self.training = False
        try:
            return super().forward(hidden_states, *args, **kwargs)
        finally:
            self.training = True


def use_tensor_parallel_moe_layers(model: torch.nn.Module) -> None:
    """Make every MoELayer of a built model a `TensorParallelMoELayer` (in place; same state, same
    submodules). After construction, so megatron's layer builder still recognises the MoE spec."""
    for module in model.modules():
        if type(module) is MoELayer:
            module.__class__ = TensorParallelMoELayer
