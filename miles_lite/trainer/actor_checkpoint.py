"""The trainer actor's checkpoint state (`TrainerActor` takes these methods): what a checkpoint saves of a
rank, and putting it back. The checkpoint layer (`checkpoint/trainer_state.py`) turns it into HF-named pieces."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from miles_lite.config.offload import KEPT_PARTS, OFFLOAD_PARTS
from miles_lite.trainer import cpu_compat
from miles_lite.trainer.dist_optimizer import (
    DistributedOptimizerState,
    finish_offloaded_load,
    gather_state,
    group_steps,
    is_distributed,
    scatter_state,
    set_group_steps,
)
from miles_lite.trainer.hf_convert import iter_hf_state, tensor_sha256
from miles_lite.trainer.lora import base_reference
from miles_lite.trainer.rng import capture_rank_rng, restore_rank_rng


class ActorCheckpoint:
    """Checkpoint state of `TrainerActor` (a mixin over its model, optimizer, schedule and counters)."""

    # Provided by TrainerActor.
    cfg: Any
    par: Any
    lora: Any
    policy: Any
    layouts: Any
    trained: Any
    optimizer: Any
    scheduler: Any
    offloader: Any
    guard: Any
    steps_done: int
    nonfinite_in_a_row: int
    nonfinite_total: int
    diverged_total: int
    _require_ready: Callable[[], None]
    # SHA-256 of every base tensor of a LoRA trainer, computed at the first checkpoint (`lora_checkpoint_info`).
    _lora_base_sha256: dict[str, str] | None = None

    def state_dict_for_checkpoint(self) -> dict[str, Any]:
        """This rank's model shard, optimizer and LR-schedule state, RNG streams and counters.

        Tensors are live references (the checkpointer snapshots them to host memory).
        """
        self._require_ready()
        # Not the gradients: no checkpoint holds them (a hand-off frees them before its checkpoint).
        self.offloader.require_resident(KEPT_PARTS, "a checkpoint")
        if is_distributed(self.optimizer):  # its ranges gathered per parameter: any DP size resumes them
            optimizer: Any = DistributedOptimizerState(
                gather_state(self.optimizer, self.policy.model, self.par.dp_group), group_steps(self.optimizer))
        else:
            optimizer = self.optimizer.state_dict()
        return {
            "model": {n: p.detach() for n, p in self.trained.named_parameters()},
            "optimizer": optimizer,
            "scheduler": self.scheduler.state_dict(),
            "rng": capture_rank_rng(),
            "counters": {"steps_done": self.steps_done, "nonfinite_in_a_row": self.nonfinite_in_a_row,
                         "nonfinite_total": self.nonfinite_total, "diverged_total": self.diverged_total},
            "parallel": {"tp_rank": self.par.tp_rank, "tp_size": self.par.tp_size,
                         "dp_rank": self.par.dp_rank, "dp_size": self.par.dp_size},
        }

    def lora_checkpoint_info(self) -> dict[str, Any] | None:
        """What a checkpoint records of the LoRA setup: the adapter's PEFT config, the base it sits on, and the
        SHA-256 of every base tensor as the trainer holds it now (HF names; on the rank that writes the shared
        tree, empty elsewhere), which pins the base: resuming onto another base is refused. Every rank must call
        it (the base is gathered over TP one parameter at a time)."""
        if self.lora is None:
            return None
        if self._lora_base_sha256 is None:
            # Once per trainer: the base is frozen and no checkpoint loads it, so every later save would hash
            # the same bits again (a full pass over the base, inside the checkpoint's blocking time).
            self.offloader.require_resident(("params",), "fingerprinting the LoRA base")
            writer = self.par.tp_rank == 0 and self.par.dp_rank == 0
            digests: dict[str, str] = {}
            with cpu_compat.device_mode():
                for part in iter_hf_state(self.policy.model, self.layouts, self.par.tp_group, self.par.ep_group,
                                          self.policy.spec.num_experts):
                    if writer:
                        digests.update({name: tensor_sha256(t) for name, t in part.items()})
            self._lora_base_sha256 = digests
        dtype = str(next(self.policy.model.parameters()).dtype).removeprefix("torch.")
        return {"adapter": self.lora.lora.peft_config(None), "base": base_reference(self.cfg.model),
                "base_sha256": dict(self._lora_base_sha256), "base_dtype": dtype}

    @torch.no_grad()
    def load_checkpoint_state(self, state: Mapping[str, Any]) -> None:
        """Restore what `state_dict_for_checkpoint` returned on a rank with the same TP/DP coordinates."""
        self._require_ready()
        self.offloader.require_resident(OFFLOAD_PARTS, "restoring a checkpoint")
        self.offloader.drop_staged()  # the restore writes every part
        mine = {"tp_rank": self.par.tp_rank, "tp_size": self.par.tp_size}
        saved = {k: state["parallel"][k] for k in mine}
        if saved != mine:
            raise ValueError(f"checkpoint shard is for {saved}, this rank is {mine}; resume with the same trainer.tp")
        params = dict(self.trained.named_parameters())
        missing = sorted(set(params) - set(state["model"]))
        if missing:
            raise KeyError(f"checkpoint lacks parameters {missing[:4]}")
        for name, p in params.items():
            p.copy_(state["model"][name])
        # The optimizer's state (moments, steps) comes from the checkpoint; its hyperparameters (the LR bounds
        # the schedule reads, betas, eps, weight decay) stay the configured ones, so a resume can change them.
        configured = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        with cpu_compat.device_mode():
            saved = state["optimizer"]
            if isinstance(saved, DistributedOptimizerState) != is_distributed(self.optimizer):
                raise ValueError("the checkpoint's optimizer state and this trainer's optimizer differ in "
                                 "trainer.use_distributed_optimizer; resume with the setting it was saved with")
            if isinstance(saved, DistributedOptimizerState):
                scatter_state(self.optimizer, self.policy.model, saved.params or {})
                set_group_steps(self.optimizer, saved.group_steps)
                finish_offloaded_load(self.optimizer)
            else:
                self.optimizer.load_state_dict(saved)
        for group, hyper in zip(self.optimizer.param_groups, configured, strict=True):
            group.update(hyper)
        self.scheduler.load_state_dict(state["scheduler"])  # built with override: the configured schedule
        if self.guard is not None:
            self.guard.invalidate()  # the weights it carried norms of were replaced
        restore_rank_rng(state["rng"])
        counters = state["counters"]
        self.steps_done = int(counters["steps_done"])
        self.nonfinite_in_a_row = int(counters["nonfinite_in_a_row"])
        self.nonfinite_total = int(counters["nonfinite_total"])
        self.diverged_total = int(counters.get("diverged_total", 0))
