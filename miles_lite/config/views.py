"""What each role reads of the run's configuration: small typed views the run layer builds from `MilesConfig`.

Below the run layer no component takes the whole configuration: it receives the sections it reads
(`DataConfig`, `RolloutConfig`, ...) or, where it reads a few fields of several, one of these views. A view
holds values already derived for its role (the flags the engines launch with, the collective backend of the
weight push, the model's vocabulary), so the role does not re-derive them from sections it does not own.
`of(cfg)` builds each view; only the run layer, the command line and this package call it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from miles_lite.config.engine_launch import launch_rollout
from miles_lite.config.lora_serving import serves_adapters
from miles_lite.config.schema import (
    AlgoConfig,
    CheckpointConfig,
    ClusterConfig,
    FaultToleranceConfig,
    LoraConfig,
    MilesConfig,
    ModelConfig,
    RolloutConfig,
    TrainerConfig,
    WeightSyncConfig,
)
from miles_lite.config.validate import model_dims


@dataclass(frozen=True)
class ActorConfig:
    """One trainer rank: the model it builds, its optimisation and parallelism, the loss, and the teacher of
    on-policy distillation (`experiment.teacher_path`); `steps` (`experiment.steps`) sizes the LR schedule."""

    model: ModelConfig
    trainer: TrainerConfig
    algo: AlgoConfig
    steps: int = 1
    teacher_path: str | None = None

    @classmethod
    def of(cls, cfg: MilesConfig) -> ActorConfig:
        return cls(cfg.model, cfg.trainer, cfg.algo, max(cfg.experiment.steps, 1), cfg.experiment.teacher_path)


@dataclass(frozen=True)
class TrainerRoleConfig:
    """The trainer role: its ranks (`actor`), their checkpoints, where they run (`cluster`) and the engines'
    addresses (`rollout.engine_urls`: the route to them picks the address a weight-update group advertises)."""

    actor: ActorConfig
    checkpoint: CheckpointConfig
    cluster: ClusterConfig
    engine_urls: tuple[str, ...] = ()

    @classmethod
    def of(cls, cfg: MilesConfig) -> TrainerRoleConfig:
        return cls(ActorConfig.of(cfg), cfg.checkpoint, cfg.cluster, tuple(cfg.rollout.engine_urls))


@dataclass(frozen=True)
class EngineFleetConfig:
    """The engines and the fleet that keeps them: `rollout` as the engines launch (flags derived from the rest
    of the run included: the memory saver of a hand-off, LoRA serving, decode CUDA graphs sized to the batch),
    the restart budget and health checks (`fault_tolerance`), where the engines run (`cluster`), the model they
    serve and its vocabulary."""

    rollout: RolloutConfig
    fault_tolerance: FaultToleranceConfig
    cluster: ClusterConfig
    model_path: str | None
    vocab_size: int
    model_arch: str = ""
    model_name: str = ""
    # A random model (no `model.hf_path`, or the one a run writes under its directory): it speaks the offline
    # ChatML tokenizer whatever its architecture.
    tiny_model: bool = False

    @classmethod
    def of(cls, cfg: MilesConfig) -> EngineFleetConfig:
        path = str(cfg.model.hf_path) if cfg.model.hf_path else None
        tiny = path is None or (Path(path) / "miles_lite_spec.json").is_file()
        return cls(launch_rollout(cfg), cfg.fault_tolerance, cfg.cluster, path, model_dims(cfg).vocab_size,
                   cfg.model.arch, cfg.model.name, tiny)


@dataclass(frozen=True)
class WeightSyncSetup:
    """The weight push: `weight_sync.*`, plus what it needs of the trainer and the engines. `adapters` is the
    trainer's LoRA config when pushes carry only adapters (`weight_sync.lora=adapter|tensors`), else None."""

    weight_sync: WeightSyncConfig
    trainer_tp: int
    dtype: str
    engine_backend: str
    collective_backend: str
    advertise_address: str | None
    engine_urls: tuple[str, ...]
    vocab_size: int
    seed: int
    adapters: LoraConfig | None = None
    base_model: str | None = None
    # The probe's bound (`weight_sync.max_probe_logp_diff`, or the one chosen for the run) and, when chosen,
    # why (named in a failed verification's message).
    probe_bound: float = 1e-3
    probe_bound_note: str = ""

    @classmethod
    def of(cls, cfg: MilesConfig) -> WeightSyncSetup:
        from miles_lite.config.weight_sync_choice import collective_backend, probe_bound

        bound, note = probe_bound(cfg)
        return cls(cfg.weight_sync, cfg.trainer.tp, "float32" if cfg.trainer.precision == "fp32" else "bfloat16",
                   cfg.rollout.backend, collective_backend(cfg), cfg.cluster.advertise_address,
                   tuple(cfg.rollout.engine_urls), model_dims(cfg).vocab_size, cfg.experiment.seed,
                   cfg.trainer.lora if serves_adapters(cfg) else None,
                   str(cfg.model.hf_path) if cfg.model.hf_path else None, bound, note)
