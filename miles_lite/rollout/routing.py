"""Which engine answers carry MoE routing, and how they become a sample's compact expert ids.

Engines answer `return_routed_experts` requests with SGLang's `meta_info.routed_experts` (int32 ids
`[prompt + completion - 1, num_hidden_layers, top_k]`, dense layers zero). A sample keeps the rows of its
response positions that the engine ran (`P .. P + R - 2`), at the MoE layers only, as int8 (up to 128
experts) or int16: for a Qwen3-30B-A3B response of 1,000 tokens, 48 x 8 bytes a token, 384 kB.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class RoutingLayout:
    """What the engines' routed-expert arrays hold: every hidden layer's top-k, of which `moe_layers` route."""

    num_hidden_layers: int
    moe_layers: tuple[int, ...]
    top_k: int
    num_experts: int

    @staticmethod
    def of_config(cfg: Mapping[str, Any]) -> RoutingLayout | None:
        """From an HF config.json dict: a Qwen3-MoE layout (as transformers places MoE layers), or None."""
        if cfg.get("model_type") != "qwen3_moe":
            return None
        experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
        if experts < 1:
            return None
        layers = int(cfg["num_hidden_layers"])
        step = int(cfg.get("decoder_sparse_step") or 1)
        dense = {int(i) for i in cfg.get("mlp_only_layers") or ()}
        moe = tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0)
        return RoutingLayout(layers, moe, int(cfg["num_experts_per_tok"]), experts)

    def sample_ids(self, flat: np.ndarray, prompt_len: int, response_len: int) -> np.ndarray:
        """The compact ids `[R - 1, MoE layers, top_k]` of a response from an answer's flat int32 array over
        the whole sequence; raises ValueError when the array does not cover the sequence."""
        per_row = self.num_hidden_layers * self.top_k
        rows = prompt_len + response_len - 1
        if flat.size != rows * per_row:
            raise ValueError(f"routed_experts holds {flat.size} ids; {rows} positions x {self.num_hidden_layers} "
                             f"layers x top-{self.top_k} = {rows * per_row} expected")
        ids = flat.reshape(rows, self.num_hidden_layers, self.top_k)[prompt_len:, list(self.moe_layers)]
        dtype = np.int8 if self.num_experts <= 128 else np.int16
        return np.ascontiguousarray(ids, dtype=dtype)
