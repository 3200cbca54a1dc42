"""Engine flags for serving a LoRA run's adapters (`trainer.lora.rank` > 0, `weight_sync.lora=adapter`).

SGLang needs `--enable-lora`, and, since no adapter exists when it starts, the largest rank
(`--max-lora-rank`) and the projections adapters may target (`--lora-target-modules`) to size its
adapter memory pool; the reference engine takes the first two.
"""

from __future__ import annotations

import dataclasses

from miles_lite.config.schema import MilesConfig


def with_lora_serving(cfg: MilesConfig) -> MilesConfig:
    """`cfg` with the engines' LoRA flags added to `rollout.sglang_args` / `rollout.reference_args` (unchanged
    when the run pushes full or merged weights). Flags the user set explicitly are kept."""
    lora = cfg.trainer.lora
    if lora.rank == 0 or cfg.weight_sync.lora != "adapter":
        return cfg
    sglang = {"enable_lora": True, "max_lora_rank": lora.rank, "lora_target_modules": list(lora.targets),
              **dict(cfg.rollout.sglang_args)}
    reference = {"enable_lora": True, "max_lora_rank": lora.rank, **dict(cfg.rollout.reference_args)}
    rollout = dataclasses.replace(cfg.rollout, sglang_args=sglang, reference_args=reference)
    return dataclasses.replace(cfg, rollout=rollout)
