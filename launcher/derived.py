"""What a MilesJob's overrides imply for its engine pods, read the way Hydra applies them (the last override of
a key wins; `~key` unsets it): adapter pushes (`trainer.lora.rank` > 0 without `weight_sync.lora=merged`) and
rollout routing replay (`trainer.routing_replay=true`).

A run the launcher starts derives these engine flags from its configuration (`miles_lite.config.lora_serving`,
`miles_lite.config.engine_launch`); engine pods are started by the operator, so it derives the same flags here:
SGLang pods get `enable_lora`, `max_lora_rank`, `lora_target_modules` and `enable_return_routed_experts` in their
`--sglang-args`, reference pods `--enable-lora --max-lora-rank R`. A flag set in `spec.rollout.sglangArgs` wins,
and one that contradicts what the job needs is refused naming it. Adapter pushes as files (`weight_sync.lora=adapter`,
the default) write each version as a PEFT directory that every engine loads from its own filesystem, so the engine
pods mount the job's volume; `weight_sync.lora=tensors` sends the adapter inside the load requests instead.
"""

from __future__ import annotations

from typing import Any

from launcher.spec import JobSpec

# PEFT projections a LoRA adapter may target (miles_lite.config.schema.LORA_TARGETS): all by default.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def override_value(job: JobSpec, key: str) -> str | None:
    """The value the job's overrides give `key` (the last one wins, `~key` unsets it), unquoted; None if unset."""
    value = None
    for o in job.overrides:
        name, sep, raw = o.partition("=")
        if name.lstrip("+~").strip() != key:
            continue
        value = None if o.startswith("~") else raw.strip().strip("'\"") if sep else None
    return value


def lora_rank(job: JobSpec) -> int:
    """`trainer.lora.rank` as the overrides set it (0: none, or a value the trainer's own check refuses)."""
    try:
        return max(int(override_value(job, "trainer.lora.rank") or 0), 0)
    except ValueError:
        return 0


def lora_targets(job: JobSpec) -> list[str]:
    """`trainer.lora.targets` as the overrides set it (`[q_proj,v_proj]`), else every projection."""
    raw = override_value(job, "trainer.lora.targets")
    if not raw:
        return list(LORA_TARGETS)
    return [t.strip().strip("'\"") for t in raw.strip("[]").split(",") if t.strip().strip("'\"")]


def pushes_adapters(job: JobSpec) -> bool:
    """Whether pushes carry LoRA adapters (as files or inside the requests), which the engine pods load."""
    return lora_rank(job) > 0 and (override_value(job, "weight_sync.lora") or "adapter") in ("adapter", "tensors")


def adapters_as_files(job: JobSpec) -> bool:
    """Whether pushes write each adapter version as a directory the engine pods load from their filesystem."""
    return lora_rank(job) > 0 and (override_value(job, "weight_sync.lora") or "adapter") == "adapter"


def replays_routing(job: JobSpec) -> bool:
    """Whether the trainer replays the experts the engines routed each generated token to."""
    return (override_value(job, "trainer.routing_replay") or "").lower() == "true"


def sglang_flags(job: JobSpec) -> dict[str, Any]:
    """The flags SGLang engine pods need for the job (before the user's `sglangArgs`, which win)."""
    flags: dict[str, Any] = {}
    if pushes_adapters(job):
        flags.update(enable_lora=True, max_lora_rank=lora_rank(job), lora_target_modules=lora_targets(job))
    if replays_routing(job):
        flags["enable_return_routed_experts"] = True
    return flags


def reference_flags(job: JobSpec) -> list[str]:
    """The flags reference engine pods need for the job."""
    return ["--enable-lora", "--max-lora-rank", str(lora_rank(job))] if pushes_adapters(job) else []


def flag_problems(job: JobSpec) -> list[str]:
    """`spec.rollout.sglangArgs` that contradict what the job needs of its engines, each naming the fix."""
    if job.rollout.backend != "sglang":
        return []
    given = {str(k).replace("-", "_"): v for k, v in job.rollout.sglang_args.items()}
    problems = []
    if pushes_adapters(job) and given.get("enable_lora", True) is not True:
        problems.append(f"spec.rollout.sglangArgs.enable_lora={given['enable_lora']!r}: trainer.lora.rank="
                        f"{lora_rank(job)} pushes adapters the engines must load; remove it (it is set for you) or "
                        "push merged weights (weight_sync.lora=merged)")
    if replays_routing(job) and given.get("enable_return_routed_experts", True) is not True:
        problems.append(f"spec.rollout.sglangArgs.enable_return_routed_experts={given['enable_return_routed_experts']!r}"
                        ": trainer.routing_replay=true replays the experts SGLang routed, which it returns only with "
                        "this flag; remove it (it is set for you) or set trainer.routing_replay=false")
    return problems
