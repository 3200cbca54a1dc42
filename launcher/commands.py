"""What the pods of a MilesJob run: the resolved Hydra overrides and the container command lines.

Pure functions of a `JobSpec`. The overrides are written to the job's ConfigMap (one per line) and
read back by the containers, so the ConfigMap is the single record of what a run was told.
"""

from __future__ import annotations

import json
import shlex
from typing import Any

from launcher import derived
from launcher.spec import JobSpec, SpecError

CONFIG_MOUNT = "/etc/miles-lite"
OVERRIDES_FILE = "overrides"
# The engines' URLs, one per line: the running trainer's fleet follows it (rollout.engine_urls_file), so
# scaling the engines changes this file and the two overrides in SCALING_KEYS, never the trainer's pods.
ENGINES_FILE = "engines"
SCALING_KEYS = ("rollout.engines", "rollout.engine_urls")
RAY_PORT = 6379
# Seconds a worker trainer pod polls the Ray head before giving up.
RAY_JOIN_TIMEOUT_S = 600

# Hydra keys the operator sets from the MilesJob spec; a user override of one is a conflict.
MANAGED_KEYS = (
    "model.hf_path", "rollout.backend", "rollout.engines", "rollout.engine_urls", "rollout.engine_urls_file",
    "rollout.engine_tp",
    "checkpoint.dir", "checkpoint.interval", "checkpoint.keep_last", "checkpoint.resume",
    "fault_tolerance.max_engine_restarts", "observability.metrics_port", "observability.metrics_host",
    "cluster", "cluster.mode", "cluster.ray_address", "cluster.advertise_address", "experiment.output_dir",
    "weight_sync.disk_dir",
)
# Weight transports that cross pods: the distributed group (the trainer's Service address) and, with a
# volume both roles mount, the disk. CUDA IPC needs the engines on the trainer's own GPUs (one pod).
POD_TRANSPORTS = ("distributed", "disk")
# SGLang flags the renderer owns (the pod's address and the weights location).
MANAGED_SGLANG_ARGS = ("model_path", "host", "port")


def trainer_name(job: JobSpec) -> str:
    """Name of the trainer Job and of its headless Service (the pods' DNS subdomain)."""
    return f"{job.name}-trainer"


def rollout_name(job: JobSpec) -> str:
    """Name of the rollout headless Service; engine pods are `<this>-<index>`."""
    return f"{job.name}-rollout"


def engine_pod_name(job: JobSpec, index: int) -> str:
    """Pod name (and hostname) of engine `index` (0-based)."""
    return f"{rollout_name(job)}-{index}"


def trainer_head_host(job: JobSpec) -> str:
    """DNS name of trainer pod 0 (the driver and, for several replicas, the Ray head)."""
    return f"{trainer_name(job)}-0.{trainer_name(job)}.{job.namespace}.svc"


def engine_urls(job: JobSpec) -> list[str]:
    """Base URLs of the engines, through the rollout Service's per-pod DNS records."""
    svc = rollout_name(job)
    return [f"http://{engine_pod_name(job, i)}.{svc}.{job.namespace}.svc:{job.rollout.port}"
            for i in range(job.rollout.engines)]


def engine_tp(job: JobSpec) -> int:
    """Tensor-parallel size of each engine: sglangArgs.tp_size, else its GPU count (1 for CPU engines)."""
    tp = job.rollout.sglang_args.get("tp_size")
    if job.rollout.backend == "sglang" and tp is not None:
        return int(tp)
    return max(job.rollout.gpus_per_engine, 1) if job.rollout.backend == "sglang" else 1


def _override_key(override: str) -> str:
    return override.lstrip("+~").split("=", 1)[0].strip()


def weight_transport(job: JobSpec) -> str | None:
    """The weight transport the user's overrides select (`weight_sync=X` or `weight_sync.transport=X`, last
    wins), or None for the recipe's own choice (the distributed group in every shipped recipe)."""
    transport = None
    for o in job.overrides:
        key, _, value = o.partition("=")
        if _override_key(key) in ("weight_sync", "weight_sync.transport") and not o.startswith("~"):
            transport = value.strip().strip("'\"")
    return transport


def shares_volume(job: JobSpec) -> bool:
    """Whether engine pods mount the job's checkpoint volume too: the disk transport's shared directory, or the
    directory of pushed LoRA adapters each engine loads."""
    return weight_transport(job) == "disk" or derived.adapters_as_files(job)


def _transport_problems(job: JobSpec) -> list[str]:
    transport = weight_transport(job)
    if derived.pushes_adapters(job):
        # The adapter push writes files (or sends the tensors in its requests) whatever the transport: only the
        # volume matters.
        if job.checkpoint.claim_name or not derived.adapters_as_files(job):
            return []
        return [f"spec.overrides: trainer.lora.rank={derived.lora_rank(job)} pushes each adapter version as a "
                "directory the engine pods load, so trainer and engine pods need one shared volume; set "
                "spec.checkpoint.volume.claimName to a ReadWriteMany PVC, send the adapters inside the load "
                "requests (weight_sync.lora=tensors), or push merged weights (weight_sync.lora=merged)"]
    if transport is None or transport == "distributed":
        return []
    where = "spec.overrides: weight_sync"
    if transport not in POD_TRANSPORTS:
        return [f"{where}.transport={transport}: engine pods are not on the trainer's GPUs; use "
                "weight_sync=distributed (or weight_sync=disk with a shared volume)"]
    if not job.checkpoint.claim_name:
        return [f"{where}.transport=disk: trainer and engine pods need one shared volume; set "
                "spec.checkpoint.volume.claimName to a ReadWriteMany PVC, or use weight_sync=distributed"]
    return []


def resolved_overrides(job: JobSpec) -> list[str]:
    """The user's overrides followed by the ones the deployment dictates; raises SpecError on a conflict."""
    problems = []
    for i, o in enumerate(job.overrides):
        key = _override_key(o)
        if key in MANAGED_KEYS:
            problems.append(f"spec.overrides[{i}]: {key} is set by the operator from the MilesJob spec; "
                            "remove it and use the matching spec field")
    problems += _transport_problems(job) + derived.flag_problems(job)
    if problems:
        raise SpecError(problems)
    urls = ",".join(f"'{u}'" for u in engine_urls(job))
    managed = []
    if job.model.hf_path:
        managed.append(f"model.hf_path={job.model.hf_path}")
    managed += [
        f"rollout.backend={job.rollout.backend}",
        f"rollout.engines={job.rollout.engines}",
        f"rollout.engine_urls=[{urls}]",
        f"rollout.engine_urls_file={CONFIG_MOUNT}/{ENGINES_FILE}",
        f"rollout.engine_tp={engine_tp(job)}",
        f"checkpoint.dir={job.checkpoint.mount_path}/checkpoints",
        # Metrics, rollout tables and the summary outlive the pod on the job's volume.
        f"experiment.output_dir={job.checkpoint.mount_path}/outputs",
        f"checkpoint.interval={job.checkpoint.interval}",
        f"checkpoint.keep_last={job.checkpoint.keep_last}",
        # Every (re)start resumes from the newest complete checkpoint, so a restarted trainer continues.
        "checkpoint.resume=auto",
        f"fault_tolerance.max_engine_restarts={job.fault_tolerance.max_engine_restarts}",
        f"observability.metrics_port={job.metrics_port}",
        "observability.metrics_host=node",
        # Engine pods dial the trainer's weight-update rendezvous at trainer pod 0's Service name.
        f"cluster.advertise_address={trainer_head_host(job)}",
    ]
    if derived.adapters_as_files(job):
        managed.append(f"weight_sync.disk_dir={job.checkpoint.mount_path}/adapters")
    elif shares_volume(job):
        managed.append(f"weight_sync.disk_dir={job.checkpoint.mount_path}/weights")
    if job.trainer.replicas > 1:
        # Trainer pods form one Ray cluster headed by pod 0; the engines are external.
        managed += ["cluster=ray", "cluster.ray_address=auto"]
    else:
        managed += ["cluster=local"]
    return [*job.overrides, *managed]


def sglang_args_json(args: dict[str, Any], tp: int) -> str:
    """`sglangArgs` as the JSON object `miles-lite engine --sglang-args` takes (its tensor-parallel size
    goes to --tp); raises SpecError for flags the operator owns."""
    problems = [f"spec.rollout.sglangArgs.{key}: set by the operator from spec.model.hfPath and spec.rollout.port; "
                "remove it" for key in sorted(args) if key in MANAGED_SGLANG_ARGS]
    if problems:
        raise SpecError(problems)
    return json.dumps({k: v for k, v in args.items() if k != "tp_size"}, sort_keys=True)


def engine_sglang_args(job: JobSpec) -> dict[str, Any]:
    """The engine pods' SGLang flags: `spec.rollout.sglangArgs` plus those the job's overrides imply
    (`launcher.derived`) that it does not set, in either spelling."""
    given = {str(k).replace("-", "_") for k in job.rollout.sglang_args}
    return {**{k: v for k, v in derived.sglang_flags(job).items() if k not in given}, **job.rollout.sglang_args}


def engine_command(job: JobSpec) -> list[str]:
    """Container command of a rollout engine pod: SGLang's server, or the CPU reference engine.

    SGLang starts through `miles-lite engine --backend sglang`, which checks the flags with SGLang's own
    parser, adds the project's weight-loader plugin (TP-aware pushes) and then execs `sglang.launch_server`.
    """
    if job.rollout.backend == "sglang":
        tp = engine_tp(job)
        return ["miles-lite", "engine", "--backend", "sglang", "--model-path", str(job.model.hf_path),
                "--host", "0.0.0.0", "--port", str(job.rollout.port), "--tp", str(tp),
                "--sglang-args", sglang_args_json(engine_sglang_args(job), tp)]
    # The reference engine composes the job's config (same tiny model and seed) from the same overrides.
    flags = "".join(f" {shlex.quote(f)}" for f in derived.reference_flags(job))
    script = (
        f"mapfile -t OVERRIDES < {CONFIG_MOUNT}/{OVERRIDES_FILE}\n"
        f'exec miles-lite engine --host 0.0.0.0 --port {job.rollout.port}{flags} "${{OVERRIDES[@]}}"\n'
    )
    return ["bash", "-euc", script]


def trainer_command(job: JobSpec) -> list[str]:
    """Container command of trainer pod `$JOB_COMPLETION_INDEX`: pod 0 runs the driver, others join its Ray cluster."""
    gpus = job.trainer.gpus_per_replica
    lines = [f"mapfile -t OVERRIDES < {CONFIG_MOUNT}/{OVERRIDES_FILE}"]
    if job.trainer.replicas == 1:
        lines.append('exec miles-lite train "${OVERRIDES[@]}"')
        return ["bash", "-euc", "\n".join(lines) + "\n"]
    head = shlex.quote(f"{trainer_head_host(job)}:{RAY_PORT}")
    lines += [
        'if [ "${JOB_COMPLETION_INDEX:-0}" = "0" ]; then',
        f"  ray start --head --port={RAY_PORT} --num-gpus={gpus} --disable-usage-stats",
        '  exec miles-lite train "${OVERRIDES[@]}"',
        "fi",
        # Join only once the head answers, within a deadline.
        f"deadline=$((SECONDS + {RAY_JOIN_TIMEOUT_S}))",
        f"until ray health-check --address={head} >/dev/null 2>&1; do",
        f'  if [ "$SECONDS" -ge "$deadline" ]; then echo "ray head {head} not up after {RAY_JOIN_TIMEOUT_S}s" >&2; '
        "exit 1; fi",
        "  sleep 2",
        "done",
        f"exec ray start --address={head} --num-gpus={gpus} --disable-usage-stats --block",
    ]
    return ["bash", "-euc", "\n".join(lines) + "\n"]
