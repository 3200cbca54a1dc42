"""The engine flags a LoRA run's adapter pushes need (`trainer.lora.rank` > 0, `weight_sync.lora` adapter or
tensors), and what contradicts them in the flags the user set (`rollout.sglang_args` / `rollout.reference_args`).

SGLang (0.5.23: `srt/arg_groups/fields/lora.py`, `srt/lora/`) serves adapters loaded at run time only with
`--enable-lora`; with no adapter at start it sizes its adapter memory pool from `--max-lora-rank` and
`--lora-target-modules`, and refuses (`/load_lora_adapter` answers 400) an adapter of a higher rank or with a
module outside that set. It stacks q/k/v into `qkv_proj` and gate/up into `gate_up_proj`, so `q_proj` there
also admits `k_proj` and `v_proj` adapters (`get_normalized_target_modules`); `all` admits every projection.
A push loads the new version before unloading the one in service, so two adapters are loaded at once: a
`--max-loaded-loras` of 1 would evict the adapter running requests still name. The reference engine takes
`--enable-lora` and `--max-lora-rank` with the same meaning.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from miles_lite.config.engine_flags import by_flag_name
from miles_lite.config.schema import MilesConfig

# PEFT projection name -> the LoRA module SGLang's memory pool holds it in.
SGLANG_LORA_MODULE: dict[str, str] = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
                                      "o_proj": "o_proj", "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj",
                                      "down_proj": "down_proj"}
SGLANG_ALL_MODULES = frozenset({"all", "all-linear"})


# The `weight_sync.lora` values that push adapters only (a PEFT directory, or the tensors inside the request).
ADAPTER_PUSHES = ("adapter", "tensors")


def serves_adapters(cfg: MilesConfig) -> bool:
    """True when the engines must load the trainer's adapters (LoRA with adapter pushes)."""
    return cfg.trainer.lora.rank > 0 and cfg.weight_sync.lora in ADAPTER_PUSHES


def derived_lora_args(cfg: MilesConfig, engine: str) -> dict[str, Any]:
    """The flags `engine` ("sglang" or "reference") gets from `trainer.lora` (empty without adapter pushes)."""
    if not serves_adapters(cfg):
        return {}
    lora = cfg.trainer.lora
    args: dict[str, Any] = {"enable_lora": True, "max_lora_rank": int(lora.rank)}
    if engine == "sglang":
        args["lora_target_modules"] = list(lora.targets)
    return args


def merged_lora_args(cfg: MilesConfig, engine: str, user: Mapping[str, Any]) -> dict[str, Any]:
    """`user`'s flags plus the derived ones it does not set (in either spelling); the user's values win."""
    given = by_flag_name(user)
    return {**{k: v for k, v in derived_lora_args(cfg, engine).items() if k not in given}, **dict(user)}


def lora_serving_problems(cfg: MilesConfig) -> list[str]:
    """Engine flags the user set that cannot serve `trainer.lora`'s adapters (one message per problem)."""
    if not serves_adapters(cfg):
        return []
    lora = cfg.trainer.lora
    engine = cfg.rollout.backend
    field = "rollout.sglang_args" if engine == "sglang" else "rollout.reference_args"
    given = by_flag_name(cfg.rollout.sglang_args if engine == "sglang" else cfg.rollout.reference_args)
    why = (f"trainer.lora.rank={lora.rank} with weight_sync.lora={cfg.weight_sync.lora} pushes adapters into the "
           "engines; ")
    problems: list[str] = []
    if "enable_lora" in given and given["enable_lora"] is not True:
        problems.append(f"{field}.enable_lora={given['enable_lora']!r}: {why}drop it (it is set to true for you) "
                        "or use weight_sync.lora=merged")
    rank = given.get("max_lora_rank")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < lora.rank):
        problems.append(f"{field}.max_lora_rank={rank!r} is below trainer.lora.rank={lora.rank}: {why}the engine "
                        f"would refuse every adapter; drop it or set it >= {lora.rank}")
    if engine == "sglang":
        modules = given.get("lora_target_modules")
        if modules is not None:
            listed = [modules] if isinstance(modules, str) else list(modules)
            held = {SGLANG_LORA_MODULE.get(str(m).split(".")[-1], str(m).split(".")[-1]) for m in listed}
            missing = [t for t in lora.targets if SGLANG_LORA_MODULE[t] not in held]
            if missing and not held & SGLANG_ALL_MODULES:
                problems.append(f"{field}.lora_target_modules={listed} does not cover trainer.lora.targets "
                                f"{missing}: {why}drop it (the engine then gets trainer.lora.targets) or add {missing}")
        loaded = given.get("max_loaded_loras")
        if loaded is not None and (not isinstance(loaded, int) or loaded < 2):
            problems.append(f"{field}.max_loaded_loras={loaded!r}: a push loads the new adapter before unloading "
                            "the one in service, so the engine holds two; drop it or set it >= 2")
    return problems


def with_lora_serving(cfg: MilesConfig) -> MilesConfig:
    """`cfg` with the engines' LoRA flags added to `rollout.sglang_args` / `rollout.reference_args` (unchanged
    when the run pushes full or merged weights). Flags the user set explicitly, in either spelling, are kept."""
    if not serves_adapters(cfg):
        return cfg
    sglang = merged_lora_args(cfg, "sglang", cfg.rollout.sglang_args)
    reference = merged_lora_args(cfg, "reference", cfg.rollout.reference_args)
    rollout = dataclasses.replace(cfg.rollout, sglang_args=sglang, reference_args=reference)
    return dataclasses.replace(cfg, rollout=rollout)
