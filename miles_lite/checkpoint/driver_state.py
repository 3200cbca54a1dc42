"""The driver's own resumable state: step, weight version, data order, RNG streams, filter.

The data order is the `PromptSource` state (seed, epoch, cursor and the epoch's full order, so a
resume continues the same permutation even after a presample filter shrank it). The RNG states
cover what the driver process draws from: Python's `random`, NumPy's global generator and torch's
CPU generator (trainer ranks keep their own streams in their shards).
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

_FORMAT = 1


def capture_driver_rng() -> dict[str, Any]:
    """Python, NumPy and torch (CPU) global RNG states."""
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def restore_driver_rng(state: dict[str, Any]) -> None:
    """Put back what `capture_driver_rng` returned."""
    for key in ("python", "numpy", "torch"):
        if key not in state:
            raise KeyError(f"driver RNG state lacks {key!r}; the checkpoint was not written by capture_driver_rng")
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


@dataclass
class DriverState:
    """What the driver needs, besides the trainer's shards, to continue a run exactly.

    Attributes:
        step: optimizer steps completed (the next step to run).
        weight_version: version of the weights last pushed to the engines (the RL steps they had taken).
        data: `PromptSource.state_dict()` (data cursor and epoch order).
        rng: `capture_driver_rng()` of the driver process.
        presample_keep: dataset indices the presample filter kept (None: no filter applied).
        extra: anything else a caller records (JSON-like values).
        run_config: the resolved configuration the run trained with (`config.changes.config_tree`).
        data_identity: what the data cursor indexes (`data.identity.data_identity`).
    """

    step: int
    weight_version: int
    data: dict[str, Any]
    rng: dict[str, Any] = field(default_factory=capture_driver_rng)
    presample_keep: list[int] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    run_config: dict[str, Any] | None = None
    data_identity: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.step < 0:
            raise ValueError(f"DriverState.step={self.step} must be >= 0")
        if self.weight_version < 0:
            raise ValueError(f"DriverState.weight_version={self.weight_version} must be >= 0")

    def manifest_meta(self) -> dict[str, Any]:
        """What the checkpoint's manifest records of this state, readable without loading the checkpoint:
        a resume compares the configuration and the data before any work."""
        meta: dict[str, Any] = {"weight_version": self.weight_version}
        if self.run_config is not None:
            meta["run_config"] = self.run_config
        if self.data_identity is not None:
            meta["data_identity"] = self.data_identity
        return meta

    def to_tree(self) -> dict[str, Any]:
        """A plain tree for the checkpoint's shared state (tensors stay tensors)."""
        return {"format": _FORMAT, **asdict(self)}

    @staticmethod
    def from_tree(tree: dict[str, Any]) -> DriverState:
        """Inverse of `to_tree`; ValueError naming the problem on a foreign tree."""
        if tree.get("format") != _FORMAT:
            raise ValueError(f"driver state format {tree.get('format')!r} is not {_FORMAT}; "
                             "the checkpoint was written by an incompatible version")
        # `rollout_buffer` (always empty) was written by earlier versions: async rollouts in flight go
        # back to the prompt stream instead (the cursor from before them is saved).
        fields = {k: v for k, v in tree.items() if k not in ("format", "rollout_buffer")}
        return DriverState(**fields)
