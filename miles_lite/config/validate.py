"""Start-up validation: every rule names the field and says how to fix it.

All problems are collected and reported together, so a user fixes a config in one round.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from miles_lite.config.engine_flags import flag_value
from miles_lite.config.resume_path import resume_problem
from miles_lite.config.schema import MilesConfig, choices, ranges


class ConfigError(ValueError):
    """One or more invalid fields; `problems` holds one line per field."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("invalid configuration:\n  - " + "\n  - ".join(problems))


@dataclass(frozen=True)
class ModelDims:
    """The dimensions the parallelism rules depend on."""

    num_attention_heads: int
    num_kv_heads: int
    vocab_size: int


# Estimators whose baseline is the group itself need at least two samples per prompt.
_GROUP_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline")


def _get(cfg: object, dotted: str) -> object:
    value = cfg
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def model_dims(cfg: MilesConfig) -> ModelDims:
    """Read head counts and vocabulary from `model.hf_path`'s config.json, or from `model.shape`."""
    if cfg.model.hf_path:
        config_file = Path(cfg.model.hf_path) / "config.json"
        hf = json.loads(config_file.read_text())
        heads = int(hf["num_attention_heads"])
        return ModelDims(heads, int(hf.get("num_key_value_heads", heads)), int(hf["vocab_size"]))
    s = cfg.model.shape
    return ModelDims(s.num_attention_heads, s.num_kv_heads, cfg.model.vocab_size)


def _check_choices(cfg: MilesConfig, problems: list[str]) -> None:
    for dotted, allowed in choices(cfg).items():
        value = _get(cfg, dotted)
        if value not in allowed:
            problems.append(f"{dotted}={value!r} is not one of {', '.join(allowed)}; set {dotted}=<one of them>")


def _check_ranges(cfg: MilesConfig, problems: list[str]) -> None:
    """Every `bounded` field of the schema within its range (NaN and infinities are outside every range)."""
    for dotted, allowed in ranges(cfg).items():
        value = _get(cfg, dotted)
        if value is None or isinstance(value, bool):
            continue
        if not isinstance(value, int | float) or not allowed.contains(value):
            wanted = allowed.describe("an integer" if isinstance(value, int) else "a finite number")
            problems.append(f"{dotted}={value!r} is out of range; set {dotted} to {wanted}")


def _check_positive(cfg: MilesConfig, problems: list[str]) -> None:
    for dotted in (
        "trainer.tp", "trainer.dp", "trainer.pp", "trainer.micro_batch_tokens", "trainer.logprob_chunk_tokens",
        "rollout.engines", "rollout.engine_tp", "rollout.prompts_per_step", "rollout.group_size",
        "rollout.max_new_tokens", "weight_sync.bucket_mib", "data.max_prompt_tokens",
        "fault_tolerance.failure_threshold", "algo.updates_per_rollout", "algo.epochs_per_rollout",
    ):
        value = _get(cfg, dotted)
        if not isinstance(value, int) or value < 1:
            problems.append(f"{dotted}={value!r} must be a positive integer")
    for dotted in ("rollout.async_steps", "experiment.steps", "experiment.warmup_steps", "checkpoint.interval",
                   "checkpoint.keep_every", "fault_tolerance.max_engine_restarts"):
        value = _get(cfg, dotted)
        if not isinstance(value, int) or value < 0:
            problems.append(f"{dotted}={value!r} must be an integer >= 0")


# Any of these makes a directory loadable by `AutoTokenizer.from_pretrained`.
LOADABLE_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def tokenizer_problem(cfg: MilesConfig) -> str | None:
    """Why `model.tokenizer_path` (or `model.hf_path`) cannot provide a tokenizer, or None.

    transformers builds an empty tokenizer for a checkpoint directory without tokenizer files, which
    encodes every prompt to no tokens; this names the field instead.
    """
    tokenizer_dir = cfg.model.tokenizer_path or cfg.model.hf_path
    if not tokenizer_dir or any((Path(tokenizer_dir) / f).is_file() for f in LOADABLE_TOKENIZER_FILES):
        return None
    field_name = "model.tokenizer_path" if cfg.model.tokenizer_path else "model.hf_path"
    return (f"{field_name}={tokenizer_dir!r} has no tokenizer ({', '.join(LOADABLE_TOKENIZER_FILES)}); set "
            "model.tokenizer_path to the directory of the model's tokenizer")


def _check_model(cfg: MilesConfig, problems: list[str]) -> ModelDims | None:
    if cfg.model.hf_path:
        config_file = Path(cfg.model.hf_path) / "config.json"
        if not config_file.is_file():
            problems.append(
                f"model.hf_path={cfg.model.hf_path!r} has no config.json; point it at an HF checkpoint "
                "directory (config.json + *.safetensors) or unset it to train a tiny random model"
            )
            return None
    problem = tokenizer_problem(cfg)
    if problem:
        problems.append(problem)
    try:
        return model_dims(cfg)
    except (KeyError, ValueError, OSError) as err:
        problems.append(f"model.hf_path: cannot read head counts from config.json ({err})")
        return None


def _check_parallelism(cfg: MilesConfig, dims: ModelDims, problems: list[str]) -> None:
    tp, heads, kv = cfg.trainer.tp, dims.num_attention_heads, dims.num_kv_heads
    if tp >= 1 and heads % tp:
        problems.append(
            f"trainer.tp={tp} must divide the model's {heads} attention heads; "
            f"choose one of {[d for d in range(1, heads + 1) if heads % d == 0]}"
        )
    if tp >= 1 and kv % tp:
        problems.append(
            f"trainer.tp={tp} must divide the model's {kv} KV groups (num_key_value_heads); "
            f"choose one of {[d for d in range(1, kv + 1) if kv % d == 0]}"
        )
    etp = cfg.rollout.engine_tp
    if etp >= 1 and heads % etp:
        problems.append(f"rollout.engine_tp={etp} must divide the model's {heads} attention heads")
    if etp >= 1 and kv % etp and etp % kv:
        # SGLang replicates KV heads when engine TP exceeds the KV groups, which needs divisibility.
        problems.append(
            f"rollout.engine_tp={etp} and the model's {kv} KV groups must divide one another"
        )
    if cfg.rollout.backend == "reference" and etp >= 1:
        # The reference engine splits the vocabulary unpadded (HF shapes) over its TP ranks.
        if dims.vocab_size % etp:
            problems.append(f"rollout.engine_tp={etp} must divide the vocabulary ({dims.vocab_size}) for the "
                            "reference engine")
        ref_tp = cfg.rollout.reference_args.get("tp", etp)
        if ref_tp != etp:
            problems.append(f"rollout.reference_args.tp={ref_tp} differs from rollout.engine_tp={etp}; "
                            "set only rollout.engine_tp")
    if cfg.trainer.pp != 1:
        problems.append("trainer.pp must be 1: pipeline parallelism is not supported yet; use trainer.tp/dp")
    ep, ranks = cfg.trainer.ep, cfg.trainer.tp * cfg.trainer.dp
    if ep > 1 and ranks % ep:
        problems.append(f"trainer.ep={ep} must divide the trainer's tp * dp = {ranks} ranks")


def _check_algo(cfg: MilesConfig, problems: list[str]) -> None:
    algo = cfg.algo
    if algo.advantage_estimator in _GROUP_ESTIMATORS and cfg.rollout.group_size < 2:
        problems.append(
            f"rollout.group_size={cfg.rollout.group_size} must be >= 2 for "
            f"algo.advantage_estimator={algo.advantage_estimator} (the group is its own baseline)"
        )
    if not 0 <= algo.clip_low < 1:
        problems.append(f"algo.clip_low={algo.clip_low} must be in [0, 1)")
    if algo.clip_high < 0:
        problems.append(f"algo.clip_high={algo.clip_high} must be >= 0")
    if algo.dual_clip_c is not None and algo.dual_clip_c <= 1:
        problems.append(f"algo.dual_clip_c={algo.dual_clip_c} must be > 1 (or null to disable dual clip)")
    if algo.is_upper <= 1:
        problems.append(f"algo.is_upper={algo.is_upper} must be > 1")
    if algo.is_lower is not None and not 0 <= algo.is_lower < 1:
        problems.append(f"algo.is_lower={algo.is_lower} must be in [0, 1) (or null for 1/is_upper)")
    if algo.agg_mode == "seq_mean_token_sum_norm" and not algo.agg_constant:
        problems.append(
            "algo.agg_constant must be set (e.g. to rollout.max_new_tokens) when "
            "algo.agg_mode=seq_mean_token_sum_norm"
        )
    if cfg.experiment.eval_every and cfg.rollout.async_steps > 1:
        # The evaluation runs between steps on the rollout engines; with more than one batch ahead a
        # generation is always in flight then.
        problems.append(f"experiment.eval_every={cfg.experiment.eval_every} needs rollout.async_steps <= 1 "
                        f"(got {cfg.rollout.async_steps}); set experiment.eval_every=0 or lower rollout.async_steps")
    if cfg.experiment.warmup == "opd" and algo.distill_coef <= 0:
        problems.append("experiment.warmup=opd needs algo.distill_coef > 0 (e.g. algo.distill_coef=1.0)")


def _check_rewards(cfg: MilesConfig, problems: list[str]) -> None:
    from miles_lite.rewards import get_reward_set
    from miles_lite.rewards.setup import NO_SET, build_reward_set

    try:
        if cfg.rewards.set != NO_SET:
            get_reward_set(cfg.rewards.set)
    except ValueError as err:
        problems.append(f"rewards.set: {err}; or none (plug-ins and the remote reward model only)")
        return
    remote = cfg.rewards.remote
    for name in ("batch_size", "max_concurrency"):
        if getattr(remote, name) < 1:
            problems.append(f"rewards.remote.{name}={getattr(remote, name)} must be a positive integer")
    if remote.timeout_s <= 0 or remote.retries < 0 or remote.backoff_s < 0:
        problems.append("rewards.remote: timeout_s must be > 0, retries and backoff_s >= 0")
    try:
        build_reward_set(cfg.rewards.set, cfg.rewards.weights, cfg.rewards.custom, remote_reward_spec(cfg),
                         cfg.rewards.by_source, cfg.rewards.answer_pattern, agent=cfg.rollout.agent is not None)
    except ValueError as err:  # PluginError is a ValueError and names its field
        problems.append(str(err))


def _check_rollout(cfg: MilesConfig, problems: list[str]) -> None:
    from miles_lite.plugins import BUILTIN_ENVIRONMENTS, environment_from_plugin, load_async_fn, load_sync_fn

    rollout = cfg.rollout
    if rollout.top_k == 0:
        # SGLang and the reference engine refuse it on the first request; say so before anything starts.
        problems.append("rollout.top_k=0 samples from no token: use -1 (no top-k cut) or a positive integer")
    if rollout.environment and rollout.generate_fn:
        problems.append("rollout.environment and rollout.generate_fn exclude each other (a generate plug-in runs its "
                        "own turns); unset one")
    if rollout.engine_urls_file and not rollout.engine_urls:
        problems.append(f"rollout.engine_urls_file={rollout.engine_urls_file!r} lists engines started elsewhere, "
                        "which the job follows once running; set rollout.engine_urls to the engines at start")
    if rollout.max_turns < 1:
        problems.append(f"rollout.max_turns={rollout.max_turns} must be a positive integer")
    if rollout.backend == "sglang" and flag_value(rollout.sglang_args, "skip_tokenizer_init") and (
            rollout.stop or rollout.environment):
        # SGLang matches stop strings on decoded text; without its tokenizer its scheduler fails on the first one.
        what = "rollout.environment's tool-call tags" if rollout.environment else f"rollout.stop={list(rollout.stop)}"
        problems.append(f"{what} are stop strings, which SGLang matches on text: set "
                        "rollout.sglang_args.skip_tokenizer_init=false (SGLang still takes and returns token ids; "
                        "model.hf_path must then hold the tokenizer files)")
    if rollout.group_filter and not rollout.dynamic_sampling:
        problems.append(f"rollout.group_filter={rollout.group_filter!r} filters dynamic sampling's groups; set "
                        "rollout.dynamic_sampling=true")
    _check_agent(cfg, problems)
    try:
        if rollout.group_filter:
            load_sync_fn(rollout.group_filter, "rollout.group_filter", positional=1)
        if rollout.environment and rollout.environment not in BUILTIN_ENVIRONMENTS:
            environment_from_plugin(rollout.environment, "rollout.environment")
        if rollout.generate_fn:
            load_async_fn(rollout.generate_fn, "rollout.generate_fn", positional=3)
    except ValueError as err:  # PluginError names the field
        problems.append(str(err))


def _check_agent(cfg: MilesConfig, problems: list[str]) -> None:
    """The agent plug-in, its chat template and the plug-in pool (see rollout/agent.py)."""
    from miles_lite.formats.chat import CHAT_TEMPLATE_CHOICES, unknown_family_message
    from miles_lite.plugins import environment_from_plugin

    rollout = cfg.rollout
    if rollout.chat_template not in CHAT_TEMPLATE_CHOICES:
        problems.append(unknown_family_message(rollout.chat_template))
    if rollout.agent and (rollout.environment or rollout.generate_fn):
        problems.append("rollout.agent runs its own turns through the session gateway: unset rollout.environment and "
                        "rollout.generate_fn")
    if rollout.agent_abort and not rollout.agent:
        problems.append(f"rollout.agent_abort={rollout.agent_abort!r} is a hook of rollout.agent, which is not set")
    if rollout.plugin_pool == "processes" and rollout.environment and rollout.environment != "calculator":
        import pickle

        try:
            env = environment_from_plugin(rollout.environment, "rollout.environment")
            if callable(getattr(env, "reset", None)):
                problems.append("rollout.plugin_pool=processes runs each environment call in a worker process, where "
                                "the per-trajectory state of rollout.environment's reset() would be lost: use "
                                "rollout.plugin_pool=threads")
            else:
                pickle.dumps(env)
        except ValueError:
            pass  # reported by the plug-in checks
        except Exception as exc:  # pickle raises several kinds
            problems.append(f"rollout.plugin_pool=processes: rollout.environment cannot be sent to a worker process "
                            f"({type(exc).__name__}: {exc}); use rollout.plugin_pool=threads")
    if not rollout.agent:
        return
    from miles_lite.plugins import check_signature, load_plugin

    try:
        for path, field in ((rollout.agent, "rollout.agent"), (rollout.agent_abort, "rollout.agent_abort")):
            if path:  # fn(base_url, api_key, record, sampling); the hook fn(base_url, api_key, record, reason)
                check_signature(load_plugin(path, field), field, positional=4)
    except ValueError as err:  # PluginError names the field
        problems.append(str(err))
    if rollout.chat_template == "hf" and cfg.model.hf_path:
        from transformers import AutoTokenizer

        from miles_lite.formats.chat import resolve_chat_template

        tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer_path or cfg.model.hf_path)
        try:
            resolve_chat_template("hf", tokenizer, cfg.model.arch, tiny=False,
                                  tokenize=lambda t: list(tokenizer(t, add_special_tokens=False)["input_ids"]))
        except ValueError as err:
            problems.append(str(err))


def remote_reward_spec(cfg: MilesConfig):
    """`rewards.remote` as the reward client's spec (None when no URL is set)."""
    from miles_lite.rewards.remote import RemoteRewardSpec

    r = cfg.rewards.remote
    if not r.url:
        return None
    return RemoteRewardSpec(url=r.url, name=r.name, weight=r.weight, max_score=r.max_score, batch_size=r.batch_size,
                            timeout_s=r.timeout_s, retries=r.retries, backoff_s=r.backoff_s,
                            max_concurrency=r.max_concurrency)


RECORD_KEYS = ("prompt_key", "messages_key", "metadata_key", "source_key", "response_key")


def _check_records(cfg: MilesConfig, problems: list[str]) -> None:
    """The key mapping of `data.source=records` (the files themselves are read, and named in errors, at start)."""
    data = cfg.data
    if data.source != "records":
        set_keys = [f"data.{k}" for k in RECORD_KEYS if getattr(data, k) is not None]
        if not data.chat_template:
            set_keys.append("data.chat_template=false")
        if set_keys:
            problems.append(f"{', '.join(set_keys)} apply to data.source=records only; set data.source=records or "
                            "remove them")
        return
    if not data.train_path:
        problems.append("data.train_path is not set; data.source=records reads records files (.jsonl, .json, "
                        ".parquet, .arrow), a datasets save_to_disk folder, a glob or a list of them")
    if (data.prompt_key is None) == (data.messages_key is None):
        problems.append("data.source=records needs exactly one of data.prompt_key (a string prompt, or chat "
                        "messages) and data.messages_key (a list of chat messages)")
    if cfg.experiment.warmup == "sft" and data.response_key is None:
        problems.append("experiment.warmup=sft on records trains on reference responses: set data.response_key, or "
                        "experiment.warmup=none")
    if cfg.rollout.environment == "calculator" and cfg.experiment.warmup == "sft":
        problems.append("rollout.environment=calculator with experiment.warmup=sft writes math solutions as tool "
                        "calls, which records do not have; use experiment.warmup=none with records")


def eval_set_problems(cfg: MilesConfig) -> list[str]:
    """Evaluation sets whose k samples could not differ (k > 1 at temperature 0), each naming the fix."""
    problems: list[str] = []
    for name, s in cfg.data.eval_sets.items():
        if s.k > 1 and s.sampling_temperature(cfg.rollout.temperature) == 0:
            given = (f"data.eval_sets.{name}.temperature=0" if s.temperature is not None else
                     "rollout.temperature=0 (the temperature of a k > 1 set without its own)")
            problems.append(f"data.eval_sets.{name}.k={s.k} with {given} samples one greedy answer {s.k} times, "
                            f"so avg@{s.k} and pass@{s.k} would equal greedy accuracy; give the set a temperature "
                            f"above 0 (data.eval_sets.{name}.temperature) or set its k to 1")
    return problems


def _check_paths_and_devices(cfg: MilesConfig, problems: list[str]) -> None:
    if cfg.data.source == "gsm8k":
        for dotted in ("data.train_path", "data.eval_path"):
            path = _get(cfg, dotted)
            if dotted == "data.eval_path" and path is None:
                continue
            if not path or not os.path.exists(str(path)):
                problems.append(
                    f"{dotted}={path!r} does not exist; data.source=gsm8k reads GSM8K jsonl or parquet files "
                    "(fields question, answer)"
                )
    _check_records(cfg, problems)
    demos, train_size = cfg.experiment.warmup_demos, cfg.data.synthetic.train_size
    if cfg.data.source == "synthetic" and demos > train_size:
        problems.append(f"experiment.warmup_demos={demos} exceeds data.synthetic.train_size={train_size}; lower "
                        "experiment.warmup_demos (0 uses every training problem)")
    if cfg.trainer.precision == "fp8" and cfg.trainer.device == "cpu":
        problems.append("trainer.precision=fp8 needs TransformerEngine on a GPU; use fp32 or bf16 on CPU")
    if cfg.trainer.layer_spec == "te" and cfg.trainer.device == "cpu":
        problems.append("trainer.layer_spec=te needs a GPU; use trainer.layer_spec=local on CPU")
    if (resume_error := resume_problem(cfg.checkpoint)) is not None:
        problems.append(resume_error)
    if cfg.rollout.async_steps >= 1 and cfg.rollout.max_staleness < 1:
        # Generation that overlaps training is always at least one version behind when it is trained on.
        problems.append(
            f"rollout.max_staleness={cfg.rollout.max_staleness} must be >= 1 with rollout.async_steps="
            f"{cfg.rollout.async_steps}, or every asynchronous rollout would be dropped"
        )
    if cfg.trainer.offload.optimizer_cpu:
        from miles_lite.config.weight_sync_choice import trainer_on_gpu

        if not trainer_on_gpu(cfg):
            problems.append("trainer.offload.optimizer_cpu=true keeps the optimizer in host memory instead of the "
                            "GPU's; the trainer runs on CPU, where it has nothing to move: set it to false")
        if not cfg.trainer.use_distributed_optimizer:
            problems.append("trainer.offload.optimizer_cpu=true is Megatron's distributed optimizer's CPU offload; "
                            "set trainer.use_distributed_optimizer=true with it")
    if cfg.trainer.use_distributed_optimizer and (cfg.trainer.lora.rank > 0 or cfg.trainer.ep > 1):
        # Its checkpoints gather whole per-parameter states over the data-parallel group; adapters and routed
        # experts (sharded over expert-parallel ranks) are not mapped that way yet.
        what = "trainer.lora.rank > 0" if cfg.trainer.lora.rank > 0 else f"trainer.ep={cfg.trainer.ep}"
        problems.append(f"trainer.use_distributed_optimizer=true with {what} is not supported; set "
                        "trainer.use_distributed_optimizer=false")
    from miles_lite.config.colocation import handoff_problems
    from miles_lite.config.engine_launch import routing_problems
    from miles_lite.config.weight_sync_choice import weight_sync_problems

    problems += weight_sync_problems(cfg) + handoff_problems(cfg) + routing_problems(cfg)


def _check_lora(cfg: MilesConfig, problems: list[str]) -> None:
    from miles_lite.config.schema import LORA_TARGETS

    lora = cfg.trainer.lora
    if lora.rank == 0:
        return
    targets = list(lora.targets)
    unknown = sorted(set(targets) - set(LORA_TARGETS))
    if unknown or not targets or len(set(targets)) != len(targets):
        what = f"unknown {unknown}" if unknown else "empty or repeated"
        problems.append(f"trainer.lora.targets={targets}: {what}; list distinct names from {list(LORA_TARGETS)}")
    if cfg.trainer.transformer.get("sequence_parallel"):
        problems.append("trainer.lora with trainer.transformer.sequence_parallel=true is not supported; drop one")
    from miles_lite.config.lora_serving import lora_serving_problems

    problems += lora_serving_problems(cfg)


def validate(cfg: MilesConfig) -> ModelDims | None:
    """Check every cross-field rule of `cfg`; raise `ConfigError` listing all problems at once.

    Returns the model dimensions the checks used (None if they could not be read).
    """
    problems: list[str] = []
    _check_choices(cfg, problems)
    _check_positive(cfg, problems)
    _check_ranges(cfg, problems)
    dims = _check_model(cfg, problems)
    if dims is not None:
        _check_parallelism(cfg, dims, problems)
    _check_algo(cfg, problems)
    _check_rewards(cfg, problems)
    _check_rollout(cfg, problems)
    _check_paths_and_devices(cfg, problems)
    problems += eval_set_problems(cfg)
    if cfg.cluster.api_key_file:
        from miles_lite.net.api_key import ApiKeyError, read_key_file

        try:
            read_key_file(cfg.cluster.api_key_file)
        except ApiKeyError as err:
            problems.append(f"cluster.api_key_file: {err}")

    _check_lora(cfg, problems)
    if problems:
        raise ConfigError(problems)
    return dims
