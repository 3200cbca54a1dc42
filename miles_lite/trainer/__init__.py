"""Megatron-core trainer: HF conversion, packed log-probs, RL/SFT steps, weight shards for sync.

Heavy modules (megatron, transformers) load on first use: import from the submodules, e.g.
`from miles_lite.trainer.actor import TrainerActor`. A role: it may import the libraries (algo, config, formats,
net) and the shared types, no other role.
"""

from miles_lite.trainer.cpu_warnings import filter_expected_cpu_warnings
from miles_lite.trainer.layout import HFPiece, LayoutKind, ParamLayout, merge_shards
from miles_lite.trainer.megatron_import import arm

# Before any submodule imports megatron (they all import this package first).
filter_expected_cpu_warnings()
arm()

__all__ = ["HFPiece", "LayoutKind", "ParamLayout", "merge_shards"]
