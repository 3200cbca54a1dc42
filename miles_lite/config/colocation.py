"""Colocated roles handing the device to each other (`cluster.placement=colocated`,
`cluster.colocated_memory=handoff`): whether a run does, and what its engines are started with.

SGLang engines of a hand-off run need its memory saver (SGLang 0.5.10 through 0.5.23, torch_memory_saver):
`--enable-memory-saver` makes SGLang allocate the weights and the KV cache inside torch_memory_saver regions
(tags `weights`, `kv_cache`), which `/release_memory_occupation` unmaps and `/resume_memory_occupation` maps
again at the same addresses (so captured decode CUDA graphs stay valid). SGLang sets up the rest itself: its
scheduler processes are spawned with torch_memory_saver's hook library in LD_PRELOAD
(`configure_subprocess`), so nothing is preloaded here. What can stop it:

- `expandable_segments:True` in PYTORCH_CUDA_ALLOC_CONF: torch_memory_saver raises at its first region
  (`_sanity_checks`); in PYTORCH_ALLOC_CONF (torch's newer name) torch would allocate past the hook, so
  nothing would be released. The engines of a hand-off run get the run's environment without it
  (`memory_saver_env`); setting it in `rollout.engine_env` is an error.
- `--weight-cache-mode daemon|client`: weights shared with SGLang's weight-cache daemon cannot be released
  (its scheduler raises, which stops the engine); an error here.
- CUDA-graph memory joins the `cuda_graph` tag only with SGLANG_MEMORY_SAVER_CUDA_GRAPH=1, which SGLang's
  breakable (prefill) graph backend refuses at start-up; without it graphs stay resident (releasing the tag
  frees nothing and is harmless), which is what hand-off runs do.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from miles_lite.config.engine_flags import flag_keys, flag_value
from miles_lite.config.offload import KEPT_PARTS, OffloadConfig
from miles_lite.config.schema import ClusterConfig, MilesConfig, RolloutConfig

MEMORY_SAVER_FLAG = "enable_memory_saver"
# Allocator settings torch_memory_saver cannot work under (see the module docstring).
ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def hands_off(cfg: MilesConfig) -> bool:
    """Whether engines sleep while the trainer trains and the trainer offloads while they generate."""
    return _hands_off(cfg.cluster)


def _hands_off(cluster: ClusterConfig) -> bool:
    return cluster.placement == "colocated" and cluster.colocated_memory == "handoff"


def saves_staged_copies(cluster: ClusterConfig, offload: OffloadConfig) -> bool:
    """Whether the trainer's checkpoints are written from the host copies a hand-off stages: those of the parts
    a checkpoint holds (`KEPT_PARTS`: the parameters and the optimizer state), queued before each step's save
    (`Handoff.prepare_push`). Such a run reserves no host buffers for its snapshots at start-up (they would
    double its pinned host memory, 87 GB at 7B); a save copies the few tensors the layout builds, and one outside
    a step (the run's last) all of them. With `trainer.offload.when=needed` what stays on the device is staged too
    on a step that saves (`prepare_push(saving=True)`)."""
    return _hands_off(cluster) and set(KEPT_PARTS) <= set(offload.parts())


def memory_saver_on(rollout: RolloutConfig) -> bool:
    """Whether SGLang engines of `rollout` start with the memory saver."""
    return rollout.backend == "sglang" and flag_value(rollout.sglang_args, MEMORY_SAVER_FLAG) is True


def engine_rollout(cfg: MilesConfig) -> RolloutConfig:
    """`cfg.rollout` as the engines are launched with: SGLang gets `--enable-memory-saver` when the roles hand
    off, since only memory it allocated through the saver can be released and resumed (an explicit `false` is
    refused by `handoff_problems` before this runs)."""
    rollout = cfg.rollout
    if not hands_off(cfg) or rollout.backend != "sglang":
        return rollout
    args = {k: v for k, v in rollout.sglang_args.items() if k not in flag_keys(rollout.sglang_args, MEMORY_SAVER_FLAG)}
    return dataclasses.replace(rollout, sglang_args={**args, MEMORY_SAVER_FLAG: True})


def expandable_segments(value: str) -> bool:
    """Whether an allocator setting (`key:value,key:value`) turns expandable segments on."""
    for item in value.split(","):
        key, _, setting = item.partition(":")
        if key.strip() == "expandable_segments" and setting.strip().lower() == "true":
            return True
    return False


def memory_saver_env(env: Mapping[str, str]) -> dict[str, str]:
    """`env` for an SGLang engine with the memory saver: `expandable_segments` dropped from the allocator
    settings (the trainer keeps its own); a setting left empty is removed."""
    out = dict(env)
    for var in ALLOC_CONF_VARS:
        if var in out and expandable_segments(out[var]):
            kept = [item for item in out[var].split(",")
                    if item.strip() and item.partition(":")[0].strip() != "expandable_segments"]
            if kept:
                out[var] = ",".join(kept)
            else:
                del out[var]
    return out


def handoff_problems(cfg: MilesConfig) -> list[str]:
    """Settings a hand-off run cannot work with, each naming the fix."""
    if not hands_off(cfg):
        return []
    problems = []
    if cfg.rollout.async_steps > 0:
        problems.append(f"rollout.async_steps={cfg.rollout.async_steps}: with cluster.placement=colocated and "
                        "cluster.colocated_memory=handoff the engines sleep while the trainer trains, so no "
                        "generation can overlap a step; set rollout.async_steps=0 or cluster.colocated_memory=resident")
    if cfg.rollout.backend != "sglang":
        return problems
    setting = flag_value(cfg.rollout.sglang_args, MEMORY_SAVER_FLAG)
    if setting is not None and setting is not True:
        problems.append(f"rollout.sglang_args.enable_memory_saver={setting!r}: cluster.colocated_memory=handoff puts "
                        "the engines to sleep through SGLang's memory saver (/release_memory_occupation), which "
                        "needs it on; remove the setting (hand-off runs turn it on) or set "
                        "cluster.colocated_memory=resident")
    cache = flag_value(cfg.rollout.sglang_args, "weight_cache_mode")
    if cache not in (None, "off"):
        # SGLang refuses to release or resume weights shared with its weight-cache daemon, and the refusal
        # (an exception in its scheduler) stops the engine.
        problems.append(f"rollout.sglang_args.weight_cache_mode={cache!r}: SGLang cannot release weights it shares "
                        "with its weight-cache daemon; remove the setting (or set it to off) or set "
                        "cluster.colocated_memory=resident")
    for var in ALLOC_CONF_VARS:
        value = cfg.rollout.engine_env.get(var)
        if value is not None and expandable_segments(str(value)):
            problems.append(f"rollout.engine_env.{var}={value!r}: SGLang's memory saver (torch_memory_saver) does "
                            "not work with expandable_segments:True; remove it from rollout.engine_env or set "
                            "cluster.colocated_memory=resident")
    return problems
