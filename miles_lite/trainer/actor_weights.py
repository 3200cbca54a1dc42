"""The trainer actor's weights out (`TrainerActor` takes these methods): its shards for a weight push, its
LoRA adapters, and the whole model as HF tensors for an export."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import Tensor

from miles_lite.trainer import cpu_compat
from miles_lite.trainer.hf_convert import gather_hf_state
from miles_lite.trainer.layout import ParamLayout


class ActorWeights:
    """Weights out of `TrainerActor` (a mixin over its model, LoRA adapters, layouts and offload state)."""

    # Provided by TrainerActor.
    par: Any
    lora: Any
    policy: Any
    layouts: Any
    trained_layouts: Any
    offloader: Any
    _require_ready: Any

    def named_shards(self) -> Iterator[tuple[str, Tensor, ParamLayout]]:
        """This rank's parameter shards for weight sync: `(megatron_name, local tensor, layout)`.

        Tensors are the live parameters (detached): consume them before the next step.
        """
        self._require_ready()
        self.offloader.require_resident(("params",), "reading the weights")
        for name, param in self.policy.model.named_parameters():
            # LoRA: base + adapter, computed per shard (no communication).
            value = param.detach() if self.lora is None else self.lora.merged(name, param.detach())
            yield name, value, self.layouts[name]

    def adapter_state(self) -> dict[str, Tensor]:
        """LoRA: the full adapter tensors under their PEFT names (gathered over TP, on CPU) on global rank 0;
        an empty dict elsewhere. Every rank must call it."""
        self._require_ready()
        if self.lora is None:
            raise RuntimeError("no LoRA adapters: set trainer.lora.rank > 0")
        self.offloader.require_resident(("params",), "reading the adapters")
        with cpu_compat.device_mode():
            state = gather_hf_state(self.lora, self.trained_layouts, self.par.tp_group)
        return state if self.par.rank == 0 else {}

    def export_hf_state_dict(self) -> dict[str, Tensor]:
        """Full HF tensors (gathered over TP, on CPU) on global rank 0; an empty dict elsewhere.

        Every rank must call it (it all-gathers). With tied embeddings there is no `lm_head.weight`.
        """
        self._require_ready()
        self.offloader.require_resident(("params",), "exporting the weights")
        merged = self.lora.merged_into(self.policy.model) if self.lora is not None else contextlib.nullcontext()
        with cpu_compat.device_mode(), merged:
            state = gather_hf_state(self.policy.model, self.layouts, self.par.tp_group, self.par.ep_group,
                                    self.policy.spec.num_experts)
        return state if self.par.rank == 0 else {}

