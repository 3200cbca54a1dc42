"""Engine flags for serving a LoRA run's adapters (`trainer.lora.rank` > 0, `weight_sync.lora=adapter`).

SGLang needs `--enable-lora`, and, since no adapter exists when it starts, the largest rank
(`--max-lora-rank`) and the projections adapters may target (`--lora-target-modules`) to size its
adapter memory pool; the reference engine takes the first two. `config/lora_serving.py` derives them from
`trainer.lora` and lists what in the user's flags contradicts them (checked with the rest of the config).
"""

from __future__ import annotations

import dataclasses

from miles_lite.config.lora_serving import merged_lora_args, serves_adapters
from miles_lite.config.schema import MilesConfig


def with_lora_serving(cfg: MilesConfig) -> MilesConfig:
    """`cfg` with the engines' LoRA flags added to `rollout.sglang_args` / `rollout.reference_args` (unchanged
    when the run pushes full or merged weights). Flags the user set explicitly, in either spelling, are kept."""
    if not serves_adapters(cfg):
        return cfg
    sglang = merged_lora_args(cfg, "sglang", cfg.rollout.sglang_args)
    reference = merged_lora_args(cfg, "reference", cfg.rollout.reference_args)
    rollout = dataclasses.replace(cfg.rollout, sglang_args=sglang, reference_args=reference)
    return dataclasses.replace(cfg, rollout=rollout)
