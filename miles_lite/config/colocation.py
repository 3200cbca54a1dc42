"""Colocated roles handing the device to each other (`cluster.placement=colocated`,
`cluster.colocated_memory=handoff`): whether a run does, and what its engines are started with."""

from __future__ import annotations

import dataclasses

from miles_lite.config.schema import MilesConfig, RolloutConfig


def hands_off(cfg: MilesConfig) -> bool:
    """Whether engines sleep while the trainer trains and the trainer offloads while they generate."""
    return cfg.cluster.placement == "colocated" and cfg.cluster.colocated_memory == "handoff"


def engine_rollout(cfg: MilesConfig) -> RolloutConfig:
    """`cfg.rollout` as the engines are launched with: SGLang gets `--enable-memory-saver` when the roles hand
    off, since only memory it allocated through the saver can be released and resumed."""
    rollout = cfg.rollout
    if not hands_off(cfg) or rollout.backend != "sglang":
        return rollout
    return dataclasses.replace(rollout, sglang_args={**rollout.sglang_args, "enable_memory_saver": True})


def handoff_problems(cfg: MilesConfig) -> list[str]:
    """Settings a hand-off run cannot work with, each naming the fix."""
    if not hands_off(cfg):
        return []
    problems = []
    if cfg.rollout.async_steps > 0:
        problems.append(f"rollout.async_steps={cfg.rollout.async_steps}: with cluster.placement=colocated and "
                        "cluster.colocated_memory=handoff the engines sleep while the trainer trains, so no "
                        "generation can overlap a step; set rollout.async_steps=0 or cluster.colocated_memory=resident")
    if cfg.rollout.backend == "sglang" and cfg.rollout.sglang_args.get("enable_memory_saver") is False:
        problems.append("rollout.sglang_args.enable_memory_saver=false: colocated hand-off releases engine memory "
                        "through SGLang's memory saver; remove the setting or set cluster.colocated_memory=resident")
    return problems
