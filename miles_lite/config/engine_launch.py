"""The flags the engines are launched with: `rollout.sglang_args` / `rollout.reference_args` plus what the rest of
the run implies, each added only where the user did not set it (in either spelling).

- The memory saver of a hand-off run (`colocation.engine_rollout`).
- SGLang's `--enable-return-routed-experts` with rollout routing replay (`trainer.routing_replay=true`):
  SGLang (0.5.17: `enable_return_routed_experts`, `exec.features`) records the experts each token was routed to
  only when started with it, and without it answers `return_routed_experts` requests with no routing, so the
  trainer would route generated tokens itself. An explicit `false` is refused (`routing_problems`).
- SGLang's decode CUDA graphs sized to the batch each engine decodes: SGLang captures decode graphs up to a batch
  it picks from the GPU's memory (256 on an H200 at TP < 4) and runs larger batches eagerly, 2-2.5x slower
  (measured on one H200: a step's 512 requests generated at 18-27k tokens/s with SGLang 0.5.17's default graphs
  against 44-57k inside graphs). `cuda_graph_max_bs` is set to the requests one engine holds at once: a step's
  `prompts_per_step * group_size` spread over the engines, capped by `rollout.max_inflight_per_engine`, rounded
  up to a multiple of 8 and kept within [8, 1024]. `rollout.sglang_args.cuda_graph_max_bs` (or SGLang's own
  spelling) overrides it; engines without decode graphs (`disable_cuda_graph`) get none.
"""

from __future__ import annotations

import dataclasses
import math

from miles_lite.config.colocation import engine_rollout
from miles_lite.config.engine_flags import flag_keys, flag_value
from miles_lite.config.schema import MilesConfig, RolloutConfig

DECODE_GRAPH_FLAGS = ("cuda_graph_max_bs", "cuda_graph_max_bs_decode", "cuda_graph_bs", "cuda_graph_bs_decode",
                      "cuda_graph_config")
MAX_DERIVED_GRAPH_BATCH = 1024
ROUTED_EXPERTS_FLAG = "enable_return_routed_experts"


def engine_batch(rollout: RolloutConfig) -> int:
    """The requests one engine decodes at once in a step: the step's samples over the engines, capped by
    `rollout.max_inflight_per_engine`."""
    per_engine = math.ceil(rollout.prompts_per_step * rollout.group_size / max(rollout.engines, 1))
    if rollout.max_inflight_per_engine:
        per_engine = min(per_engine, rollout.max_inflight_per_engine)
    return per_engine


def decode_graph_batch(rollout: RolloutConfig) -> int:
    """`cuda_graph_max_bs` for `rollout`'s engines: `engine_batch` rounded up to a multiple of 8, in [8, 1024]."""
    return min(max(8, 8 * math.ceil(engine_batch(rollout) / 8)), MAX_DERIVED_GRAPH_BATCH)


def with_decode_graphs(rollout: RolloutConfig) -> RolloutConfig:
    """`rollout` with SGLang's decode CUDA graphs sized to its engines' batch (see the module docstring)."""
    args = rollout.sglang_args
    if rollout.backend != "sglang" or flag_value(args, "disable_cuda_graph") is True:
        return rollout
    if any(flag_keys(args, flag) for flag in DECODE_GRAPH_FLAGS):
        return rollout
    return dataclasses.replace(rollout, sglang_args={**args, "cuda_graph_max_bs": decode_graph_batch(rollout)})


def with_routed_experts(rollout: RolloutConfig, routing_replay: bool) -> RolloutConfig:
    """`rollout` with SGLang returning routed experts when the trainer replays them (`trainer.routing_replay`)."""
    if not routing_replay or rollout.backend != "sglang" or flag_keys(rollout.sglang_args, ROUTED_EXPERTS_FLAG):
        return rollout
    return dataclasses.replace(rollout, sglang_args={**rollout.sglang_args, ROUTED_EXPERTS_FLAG: True})


def routing_problems(cfg: MilesConfig) -> list[str]:
    """Engine flags that contradict routing replay, each naming the fix."""
    setting = flag_value(cfg.rollout.sglang_args, ROUTED_EXPERTS_FLAG)
    if not cfg.trainer.routing_replay or cfg.rollout.backend != "sglang" or setting in (None, True):
        return []
    return [f"rollout.sglang_args.{ROUTED_EXPERTS_FLAG}={setting!r}: trainer.routing_replay=true replays the experts "
            "SGLang routed each generated token to, which it returns only with this flag on; remove the setting "
            "(it is turned on for you) or set trainer.routing_replay=false"]


def launch_rollout(cfg: MilesConfig) -> RolloutConfig:
    """`cfg.rollout` as the engines are launched with: the user's flags plus the derived ones."""
    return with_decode_graphs(with_routed_experts(engine_rollout(cfg), cfg.trainer.routing_replay))
