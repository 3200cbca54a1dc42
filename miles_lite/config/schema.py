"""Typed configuration: one dataclass per config group, composed into `MilesConfig`.

Hydra merges the YAML files of `conf/` into these dataclasses, so a wrong type or an unknown key
fails at composition with the field's dotted name. Cross-field rules (TP divides heads, group
sizes, known reward names) live in `validate.py`.

SGLang server arguments (`rollout.sglang_args`) and Megatron `TransformerConfig` fields (`trainer.transformer`)
pass through as mappings: any field those libraries accept can be set without this file naming it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from miles_lite.config.fields import Range, bounded, choices, one_of, ranges  # noqa: F401 (re-exported)
from miles_lite.config.offload import OffloadConfig
from miles_lite.config.task_schema import (  # noqa: F401 (re-exported)
    DataConfig,
    EvalSetConfig,
    PresampleConfig,
    RemoteRewardConfig,
    RewardsConfig,
    SyntheticDataConfig,
)


@dataclass
class TinyModelShape:
    """Shape of a randomly initialised model, used when `model.hf_path` is unset."""

    hidden_size: int = 64
    ffn_hidden_size: int = 176
    num_layers: int = 2
    num_attention_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int | None = None
    max_position_embeddings: int = 512
    rope_theta: float = 10000.0
    # HF `rope_scaling` block, e.g. {rope_type: llama3, factor: 8, low_freq_factor: 1, high_freq_factor: 4,
    # original_max_position_embeddings: 128} or {rope_type: yarn, factor: 4, original_max_position_embeddings: 128}.
    # Empty: plain RoPE.
    rope_scaling: dict[str, Any] = field(default_factory=dict)
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    qkv_bias: bool = True
    qk_norm: bool = False
    # Mixture of experts (arch qwen3_moe): routed experts, experts per token, each expert's FFN width;
    # top-k probabilities renormalised; every `decoder_sparse_step`-th layer is MoE except `mlp_only_layers`.
    num_experts: int = 0
    num_experts_per_tok: int = 2
    moe_ffn_hidden_size: int = 32
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    init_seed: int = 0


@dataclass
class ModelConfig:
    """Which model to train: an HF safetensors directory, or a tiny random one of `arch`."""

    name: str = "tiny-qwen2"
    # HF checkpoint directory (config.json + *.safetensors). None builds `shape` at random.
    hf_path: str | None = None
    # Tokenizer directory. None: the model directory's tokenizer, or the offline BPE tokenizer.
    tokenizer_path: str | None = None
    # Architecture used when building at random: qwen2 | llama | qwen3 | qwen3_moe.
    arch: str = one_of("qwen2", "llama", "qwen3", "qwen3_moe")
    # Vocabulary of the offline tokenizer (random models only).
    vocab_size: int = 512
    shape: TinyModelShape = field(default_factory=TinyModelShape)


# PEFT module names a LoRA adapter may target (mapped onto megatron-core's fused layers by the trainer).
LORA_TARGETS: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class LoraConfig:
    """Low-rank adapters trained on a frozen base (rank 0: full fine-tuning)."""

    # Adapter rank r; 0 trains every weight instead.
    rank: int = bounded(0, ge=0)
    # Scale of the adapter's output is alpha / rank (PEFT's lora_alpha).
    alpha: float = bounded(32.0, gt=0)
    # Dropout on the adapter's input while training (PEFT's lora_dropout).
    dropout: float = bounded(0.0, ge=0, lt=1)
    # PEFT names of the adapted projections (a subset of LORA_TARGETS).
    targets: list[str] = field(default_factory=lambda: list(LORA_TARGETS))


@dataclass
class TrainerConfig:
    """Megatron-core trainer: parallelism, precision, optimiser, schedule, memory knobs."""

    tp: int = 1
    dp: int = 1
    pp: int = 1
    # Expert parallelism of MoE models: routed experts split over `ep` ranks (ep divides tp * dp; each
    # expert stays whole on its rank, i.e. expert TP is 1).
    ep: int = bounded(1, ge=1)
    # MoE router losses: load-balancing aux loss and router z-loss coefficients (0: off).
    moe_aux_loss_coef: float = bounded(0.0, ge=0)
    moe_z_loss_coef: float = bounded(0.0, ge=0)
    # MoE token dispatcher (megatron-core's moe_token_dispatcher_type): auto | alltoall | allgather.
    # auto: alltoall on GPU, allgather on CPU (megatron's alltoall dispatcher needs CUDA streams).
    moe_token_dispatcher: str = one_of("auto", "alltoall", "allgather")
    # Rollout routing replay: response tokens go to the experts the rollout engine routed them to
    # (gates from the trainer's own router logits over those experts); prompt tokens route themselves.
    routing_replay: bool = False
    # fp32 | bf16 | fp8 (fp8 needs TransformerEngine on a GPU).
    precision: str = one_of("fp32", "bf16", "fp8")
    # TransformerEngine FP8 recipe: delayed | tensorwise | blockwise.
    fp8_recipe: str = one_of("delayed", "tensorwise", "blockwise")
    # gpu | cpu | auto (auto = gpu when CUDA is present).
    device: str = one_of("auto", "cpu", "gpu")
    # te | local (auto: te on GPU, local on CPU).
    layer_spec: str = one_of("auto", "te", "local")
    lr: float = bounded(1e-6, gt=0)
    min_lr: float = bounded(0.0, ge=0)
    lr_schedule: str = one_of("constant", "cosine", "linear")
    lr_warmup_steps: int = bounded(0, ge=0)
    weight_decay: float = bounded(0.0, ge=0)
    adam_beta1: float = bounded(0.9, ge=0, lt=1)
    adam_beta2: float = bounded(0.98, ge=0, lt=1)
    adam_eps: float = bounded(1e-8, gt=0)
    clip_grad: float = bounded(1.0, ge=0)
    # Token budget of one micro-batch. TE spec: real tokens of a packed THD row (no padding). Local
    # spec: a padded batch of B sequences of up to S tokens counts B * S (padding is computed too).
    micro_batch_tokens: int = 8192
    # Tokens whose fp32 vocabulary softmax is materialised at once when computing logprobs/entropy.
    logprob_chunk_tokens: int = 1024
    # Keep nothing over the vocabulary for the backward pass: project each chunk again there (an
    # extra output-layer GEMM). Off: each chunk's logits stay alive in the model dtype until backward.
    logprob_recompute: bool = False
    # auto | compiled | eager: fuse the memory-bound softmax passes with torch.compile (auto: on CUDA).
    logprob_kernel: str = one_of("auto", "compiled", "eager")
    use_distributed_optimizer: bool = False  # Megatron's: optimizer state sharded over the data-parallel ranks
    offload: OffloadConfig = field(default_factory=OffloadConfig)  # colocated handoff: see config/offload.py
    # LR schedule length in optimizer steps (cosine/linear decay); None: experiment.steps.
    lr_decay_steps: int | None = bounded(None, ge=1)
    # The vocabulary is padded to a multiple of tp * vocab_divisor rows (padding never enters a softmax).
    vocab_divisor: int = bounded(128, ge=1)
    # Keep a host copy of the initial weights as the KL reference model (also kept when algo.kl_coef > 0).
    keep_reference: bool = False
    seed: int = 1234
    # Non-finite loss or gradient: skip the step; stop the run after this many in a row.
    max_nonfinite_skips: int = bounded(3, ge=1)
    # Divergence guard: an optimizer step that moves the weights by more than this fraction of their norm
    # (||update|| / ||weights|| over all ranks) is undone and skipped; the run ends, with a checkpoint of
    # the last good weights, after `max_diverged_skips` in a row. Healthy steps move ~1e-4 to 1e-2 (a tiny
    # model's SFT at lr 3e-3 about 0.05). Costs one device copy of the optimizer's parameters and state;
    # 0 turns it off.
    max_update_ratio: float = bounded(0.5, ge=0)
    max_diverged_skips: int = bounded(3, ge=1)
    # Megatron TransformerConfig fields passed through verbatim (e.g. recompute_granularity).
    transformer: dict[str, Any] = field(default_factory=dict)
    # torch intra-op threads of each trainer rank on CPU (0: torch's default, one per core). On a
    # machine shared with the rollout engines, 1 avoids OpenMP threads spinning against them.
    threads: int = bounded(0, ge=0)
    # LoRA: adapters on the attention and MLP projections, the base frozen (`lora.rank` > 0 turns it on).
    lora: LoraConfig = field(default_factory=LoraConfig)

    @property
    def world_size(self) -> int:
        """Trainer ranks: tp * dp * pp."""
        return self.tp * self.dp * self.pp


@dataclass
class RolloutConfig:
    """Rollout engines and how samples are drawn from them."""

    # reference (CPU, HF transformers, SGLang's HTTP API) | sglang
    backend: str = one_of("reference", "sglang")
    engines: int = 2
    engine_tp: int = 1
    prompts_per_step: int = 8
    # Completions per prompt (the GRPO group size).
    group_size: int = 8
    max_new_tokens: int = 256
    temperature: float = bounded(1.0, ge=0)
    top_p: float = bounded(1.0, gt=0, le=1)
    top_k: int = bounded(-1, ge=-1)
    stop: list[str] = field(default_factory=list)
    # DAPO dynamic sampling: drop zero-std groups and over-sample to refill, up to this many rounds.
    dynamic_sampling: bool = False
    max_sampling_rounds: int = bounded(3, ge=1)
    request_timeout_s: float = bounded(600.0, gt=0)
    # Outstanding requests one engine is given at most; more wait in the manager. None: the engine's own
    # capacity (its running-request limit, capped at SGLang's CUDA-graph batch size), read at admission.
    max_inflight_per_engine: int | None = bounded(None, ge=1)
    # Generate the next `async_steps` steps' batches while training this one (0: synchronous); groups whose
    # oldest token is more than `max_staleness` versions behind the trainer are dropped.
    async_steps: int = 0
    max_staleness: int = bounded(1, ge=0)
    # Engine startup: seconds to wait for /health_generate before failing with the server log.
    startup_timeout_s: float = bounded(300.0, gt=0)
    # SGLang `launch_server` arguments passed through verbatim (key: flag name without dashes).
    sglang_args: dict[str, Any] = field(default_factory=dict)
    # Reference-engine arguments (batch size, dtype, threads) passed through.
    reference_args: dict[str, Any] = field(default_factory=dict)
    # Extra environment of the engine server processes, e.g. {PYTHONPATH: /opt/sglang-site} when SGLang
    # lives in its own install (its pinned torch) beside the trainer's.
    engine_env: dict[str, str] = field(default_factory=dict)
    # Multi-turn tool rollouts: a built-in environment ("calculator") or an import path
    # "package.module:Environment"; None: single-turn. Replies count against max_new_tokens.
    environment: str | None = None
    # Model turns per trajectory at most (a turn ends at a tool call or the end of the answer).
    max_turns: int = 4
    # Dynamic sampling's group filter "package.module:fn", fn(group) -> bool (True keeps the group); None: keep
    # the groups whose rewards differ (not zero-signal).
    group_filter: str | None = None
    # Rollout plug-in "package.module:fn": an async function producing each completion itself
    # (miles_lite/rollout/generate_plugin.py); None: the manager samples one turn (or tool turns).
    generate_fn: str | None = None
    # Base URLs (http://host:port) of engines started outside this run's process tree, e.g. the
    # rollout pods of a Kubernetes MilesJob; when set, no engines are launched and `engines` must equal their count.
    engine_urls: list[str] = field(default_factory=list)
    engine_urls_file: str | None = None  # engine URLs, one a line, followed while running (engine_list.py)
    # Blocking plug-in calls (tool environments' replies and resets, reward functions) run off the rollout event
    # loop in a pool of `plugin_workers` threads, or processes (picklable, stateless plug-ins); an environment
    # call past `plugin_timeout_s` fails the run as a plug-in failure.
    plugin_pool: str = one_of("threads", "processes")
    plugin_workers: int = bounded(8, ge=1)
    plugin_timeout_s: float = bounded(60.0, gt=0)
    # Agent plug-in "package.module:fn": async fn(base_url, api_key, record, sampling) -> dict | None drives any
    # number of chat-completion turns through the run's session gateway (rollout/gateway/); its session becomes
    # the sample. None: the manager samples the turns itself.
    agent: str | None = None
    # Optional hook "package.module:fn", fn(base_url, api_key, record, reason), called when an agent is stopped
    # (timeout, weight-update interruption, the run ending) to end work it started outside (a sandbox).
    agent_abort: str | None = None
    max_concurrent_agents: int = bounded(64, ge=1)
    # Seconds one agent run may take; past it the agent is stopped, counted and its sample dropped.
    agent_timeout_s: float = bounded(600.0, gt=0)
    # The chat template the gateway renders sessions with: auto (the family of model.arch), qwen2.5, qwen3,
    # llama3 (written in the project, append-only), or hf (the checkpoint's own, checked append-only at start).
    chat_template: str = "auto"
    # Template options every session starts with, e.g. {enable_thinking: false} (qwen3), {date_string: ...} (llama3).
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    # A request whose history diverges from its session's: refuse (HTTP 400) | branch (continue from the longest
    # stored prefix; the abandoned branch is not trained on).
    session_divergence: str = one_of("refuse", "branch")
    # Where the gateway listens: loopback for local runs; 0 picks a free port.
    gateway_host: str = "127.0.0.1"
    gateway_port: int = bounded(0, ge=0, le=65535)


@dataclass
class AlgoConfig:
    """Advantage estimator, policy loss and train/inference mismatch correction."""

    # grpo | dr_grpo | rloo | reinforce_pp_baseline | reinforce_pp (batch-normalised REINFORCE++; group_size >= 1)
    advantage_estimator: str = one_of("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline", "reinforce_pp")
    std_normalize: bool = True
    # Drop groups whose rewards are all equal (they carry no learning signal); always counted.
    drop_zero_signal: bool = False
    policy_loss: str = one_of("ppo", "gspo")
    clip_low: float = bounded(0.2, ge=0, lt=1)
    clip_high: float = bounded(0.28, ge=0)
    dual_clip_c: float | None = None
    kl_coef: float = bounded(0.0, ge=0)
    kl_estimator: str = one_of("k3", "k1", "k2")
    entropy_coef: float = bounded(0.0)
    # token_mean | seq_mean_token_mean | seq_mean_token_sum_norm
    agg_mode: str = one_of("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")
    agg_constant: float | None = None
    # Importance-sampling correction of the rollout/trainer mismatch:
    # none | token | sequence_product | sequence_geomean, mode truncate | mask.
    is_level: str = one_of("token", "none", "sequence_product", "sequence_geomean")
    is_mode: str = one_of("truncate", "mask")
    is_upper: float = 2.0
    is_lower: float | None = None
    # On-policy distillation term weight (needs a teacher): the weight of the OPD warm-up, and of RL steps
    # unless `rl_distill_coef` says otherwise.
    distill_coef: float = bounded(0.0, ge=0)
    # Distillation weight of the RL steps. None: 0 after an OPD warm-up (the teacher has done its job;
    # the RL reward takes over), else `distill_coef`.
    rl_distill_coef: float | None = bounded(None, ge=0)
    # Optimizer steps per rollout batch: the batch is split into this many mini-batches (shuffled), one
    # step each. With more than one step in all, the trainer's log-probs before the first step are the
    # PPO "old" policy of every step, so the ratio moves away from 1 and the clip range acts.
    updates_per_rollout: int = 1
    # Passes over each rollout batch (PPO epochs); every pass reshuffles the mini-batches.
    epochs_per_rollout: int = 1


# The SGLang weight loader that `weight_sync.transport=ipc_handles` pushes into (the engine lists it in
# `--custom-weight-loader`); named here so that config checks need not import the transport.
IPC_HANDLES_LOADER = "miles_lite.engines.sglang.ipc_loader.load_ipc_weights"


@dataclass
class WeightSyncConfig:
    """How new weights reach the engines after each optimizer step, and how pushes are verified."""

    # distributed (gloo on CPU, NCCL on GPU) | ipc (colocated CUDA IPC) | disk (safetensors)
    transport: str = one_of("distributed", "ipc", "ipc_handles", "disk")
    bucket_mib: int = 512
    # Shared directory for the disk transport (versioned subdirectories).
    disk_dir: str | None = None
    verify: bool = True
    probe_sequences: int = bounded(2, ge=0)
    probe_tokens: int = bounded(32, ge=1)
    # A push whose probe per-token |logp diff| (mean) exceeds this raises. None: chosen by precision, engines and
    # architecture (1e-3 fp32 throughout; bf16 against reference engines 1e-2, against SGLang 0.1; twice that for
    # mixture-of-experts models): see config/weight_sync_choice.py `probe_bound`.
    max_probe_logp_diff: float | None = bounded(None, gt=0)
    # shard: every engine rank receives its own slices from the trainer ranks, through the weight-loader
    # plugin; full: SGLang's own broadcast of full HF tensors from one process.
    mode: str = one_of("shard", "full")
    # The weight-update group's backend: auto (NCCL between trainer GPUs and SGLang engines on other
    # GPUs, gloo otherwise) | nccl | gloo. See config/weight_sync_choice.py.
    backend: str = one_of("auto", "nccl", "gloo")
    init_timeout_s: float = bounded(120.0, gt=0)
    # With trainer.lora.rank > 0: adapter (push only the adapter tensors as a PEFT adapter directory under
    # `disk_dir` (default <run>/adapters), loaded by each engine under a new name per version) | tensors (the
    # adapter tensors inside the load request, /load_lora_adapter_from_tensors: no directory, engines on any
    # machine) | merged (base + adapter weights through `transport`, as a full fine-tune pushes them).
    lora: str = one_of("adapter", "merged", "tensors")


@dataclass
class CheckpointConfig:
    """Async sharded checkpoints and resume."""

    dir: str | None = None
    interval: int = 0
    async_save: bool = True
    keep_last: int = bounded(2, ge=0)
    keep_every: int = 0
    # auto (newest complete checkpoint) | none | a checkpoint path
    resume: str = "auto"
    # Resume on other training data than the checkpoint's (the prompt cursor restarts on it); false: refused.
    allow_data_change: bool = False


@dataclass
class FaultToleranceConfig:
    """Health checks of rollout engines and their replacement."""

    health_interval_s: float = bounded(2.0, gt=0)
    health_timeout_s: float = bounded(5.0, gt=0)
    failure_threshold: int = 2
    max_engine_restarts: int = 3
    request_retries: int = bounded(3, ge=0)


@dataclass
class ObservabilityConfig:
    """Prometheus exporter, rollout tables, progress output, optional sinks."""

    metrics_port: int = bounded(0, ge=0, le=65535)
    # Address the exporter binds: 127.0.0.1 (local runs), or `node`: this node's own (conf/observability/cluster).
    metrics_host: str = "127.0.0.1"
    metrics_enabled: bool = True
    rollout_table: bool = True
    progress: bool = True
    # At the end of a run, keep the exporter up until one scrape has read the final values, at most this
    # many seconds (set it above the scrape interval). 0: stop at once; nothing scrapes a local run.
    linger_s: float = bounded(0.0, ge=0)
    wandb: bool = False
    # W&B project the run logs to (run name = experiment.run_name); used only when `wandb` is true.
    wandb_project: str = "miles-lite"
    tensorboard: bool = False


@dataclass
class ClusterConfig:
    """Where the roles run."""

    # local (processes on this machine) | ray
    mode: str = one_of("local", "ray")
    placement: str = one_of("disaggregated", "colocated")  # separate devices per role | shared devices
    # placement=colocated: handoff (engines sleep while training, trainer.offload.* while generating) | resident
    colocated_memory: str = one_of("handoff", "resident")
    ray_address: str | None = None
    trainer_gpus_per_rank: float = bounded(0.0, ge=0)
    engine_gpus: float = bounded(0.0, ge=0)
    cpus_per_engine: float = bounded(1.0, gt=0)
    placement_timeout_s: float = bounded(120.0, gt=0)
    # Custom Ray resource every trainer bundle / engine bundle also asks one unit of, pinning each role
    # to the nodes started for it (slurm/train.sh registers miles_trainer and miles_rollout: one unit per
    # GPU of a node, or per CPU on a GPU-less node); None: any node with the CPUs/GPUs.
    trainer_resource: str | None = None
    rollout_resource: str | None = None
    # Address engines dial for the weight-update rendezvous (trainer TP rank 0's node; the driver in mode=full);
    # None: that node's own (Ray's, or the route to rollout.engine_urls). Engines bind their node's own address.
    advertise_address: str | None = None
    # Seconds for every trainer rank (a Ray actor) to import, join the process group and build its model.
    trainer_start_timeout_s: float = bounded(600.0, gt=0)
    # Key file (0600) engines and the weight-update group ask for; None: $MILES_API_KEY(_FILE), else a fresh key.
    api_key_file: str | None = None


@dataclass
class ExperimentConfig:
    """The run itself: name, output directory, length, warm-up and evaluation."""

    name: str = "tiny_cpu"
    output_dir: str = "outputs"
    run_name: str | None = None
    steps: int = 20
    warmup: str = one_of("sft", "opd", "none")
    warmup_steps: int = 100
    warmup_batch_size: int = bounded(16, ge=1)
    warmup_lr: float = bounded(3e-3, gt=0)
    # SFT takes reference solutions from the first N training problems only (0: all); RL uses every one's answer.
    warmup_demos: int = bounded(0, ge=0)
    warmup_stop_loss: float | None = bounded(None, gt=0)  # SFT ends once its last 10 losses average below it
    # Leave the questions the SFT warm-up trained on out of the RL prompt stream (a later presample cannot add them).
    warmup_exclude_from_rl: bool = True
    # Teacher for on-policy distillation (HF directory); None: trained tiny teacher.
    teacher_path: str | None = None
    eval_every: int = bounded(0, ge=0)
    # Held-out problems / records evaluated before and after RL (and every `eval_every` steps): None (null) every
    # one of data.eval_path (GSM8K without one: the last 64 training problems, taken out of training); 0 none;
    # N the first N of data.eval_path (the cut is reported). Synthetic data holds out data.synthetic.eval_size.
    eval_size: int | None = bounded(None, ge=0)
    seed: int = 0


@dataclass
class MilesConfig:
    """The whole job. Every group maps to a directory of `conf/`."""

    model: ModelConfig = field(default_factory=ModelConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rewards: RewardsConfig = field(default_factory=RewardsConfig)
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    fault_tolerance: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)
    observability: ObservabilityConfig = field(default_factory=ObservabilityConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    experiment: ExperimentConfig = field(default_factory=ExperimentConfig)


# Config groups, in the order `conf/config.yaml` lists them.
GROUPS: tuple[str, ...] = (
    "model",
    "trainer",
    "rollout",
    "algo",
    "data",
    "rewards",
    "weight_sync",
    "checkpoint",
    "fault_tolerance",
    "observability",
    "cluster",
    "experiment",
)
