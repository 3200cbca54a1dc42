"""`trainer.offload.*`: what the trainer hands to host memory while colocated engines generate."""

from __future__ import annotations

from dataclasses import dataclass

from miles_lite.config.fields import one_of


@dataclass
class OffloadConfig:
    """What the trainer moves to (pinned) host memory while the engines generate, with
    `cluster.placement=colocated` and `cluster.colocated_memory=handoff`; each part comes back before training."""

    # The model's parameters (after the weight push and its verification, which read them on the device).
    params: bool = True
    # Megatron DDP's contiguous gradient buffers: freed, not copied (every step starts by zeroing them).
    grads: bool = True
    # The optimizer: fp32 main parameters (bf16 training), Adam moments, the divergence guard's snapshot.
    optimizer: bool = True
    # Megatron's optimizer CPU offload (any placement; GPU trainers, with trainer.use_distributed_optimizer):
    # the optimizer state lives in host memory for the whole run and the Adam step runs on the CPU.
    optimizer_cpu: bool = False
    # always: the parts above leave every step. needed: the parameters and optimizer state leave only as far as the
    # engines' memory needs: each rank measures what the engines free when they sleep and, at each push, keeps
    # on the device what still leaves them that much free with room to spare (`run/handoff.py`), so a small model
    # on a large card copies nothing.
    when: str = one_of("always", "needed")

    def parts(self) -> tuple[str, ...]:
        """The parts switched on, in `OFFLOAD_PARTS` order."""
        return tuple(p for p in OFFLOAD_PARTS if getattr(self, p))


OFFLOAD_PARTS = ("params", "grads", "optimizer")
# Parts whose values no one reads across a hand-off: their storage is freed, not copied, and comes back zeroed.
DROPPED_PARTS = frozenset({"grads"})
# The parts that hold the trainer's state: copied to the host and back, and what a checkpoint holds.
KEPT_PARTS = tuple(p for p in OFFLOAD_PARTS if p not in DROPPED_PARTS)
