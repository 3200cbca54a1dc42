"""Configuration: composition from conf/, overrides, validation messages, the CLI's --cfg."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from miles_lite.cli import main
from miles_lite.config import GROUPS, ConfigError, MilesConfig, default_config_dir, load_config, validate
from miles_lite.config.schema import TrainerConfig


def _problems(overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as info:
        validate(load_config(overrides))
    return str(info.value)


def test_default_composes_to_typed_dataclass_and_validates():
    cfg = load_config()
    assert isinstance(cfg, MilesConfig)
    assert isinstance(cfg.trainer, TrainerConfig)
    assert cfg.experiment.name == "tiny_cpu"
    assert cfg.model.arch == "qwen2" and cfg.model.shape.qkv_bias
    validate(cfg)


def test_conf_has_every_group_and_each_option_composes():
    conf = default_config_dir()
    assert {p.name for p in conf.iterdir() if p.is_dir()} == set(GROUPS)
    for group in GROUPS:
        for option in sorted((conf / group).glob("*.yaml")):
            overrides = [f"{group}={option.stem}"]
            if option.stem == "qwen2.5_0.5b":
                continue  # needs model.hf_path (mandatory): checked below
            if group == "data" and option.stem == "gsm8k":
                overrides.append("data.train_path=/nonexistent.jsonl")
            cfg = load_config(overrides)
            assert isinstance(cfg, MilesConfig), option


def test_overrides_are_typed():
    cfg = load_config(["trainer.tp=2", "rollout.engines=4", "algo.clip_high=0.3"])
    assert (cfg.trainer.tp, cfg.rollout.engines, cfg.algo.clip_high) == (2, 4, 0.3)
    with pytest.raises(Exception, match="tp"):
        load_config(["trainer.tp=two"])


def test_pass_through_mappings_accept_library_fields():
    cfg = load_config(["+rollout.sglang_args.chunked_prefill_size=4096",
                       "+trainer.transformer.recompute_granularity=selective"])
    assert cfg.rollout.sglang_args["chunked_prefill_size"] == 4096
    assert cfg.trainer.transformer == {"recompute_granularity": "selective"}


def test_tp_must_divide_heads_and_kv_groups():
    msg = _problems(["trainer.tp=3"])
    assert "trainer.tp=3 must divide the model's 4 attention heads" in msg
    assert "KV groups" in msg and "[1, 2]" in msg


def test_group_size_must_be_at_least_two_for_grpo():
    assert "rollout.group_size=1 must be >= 2" in _problems(["rollout.group_size=1"])


def test_unknown_reward_names_list_known_ones():
    msg = _problems(["+rewards.weights.style_check=1.0"])
    assert "style_check" in msg and "exact_check" in msg and "step_check" in msg
    assert "rewards.set" in _problems(["rewards.set=nope"])


def test_choices_and_every_problem_reported_at_once():
    with pytest.raises(ConfigError) as info:
        validate(load_config(["trainer.precision=fp4", "algo.is_level=word", "rollout.engines=0"]))
    problems = info.value.problems
    assert any(p.startswith("trainer.precision='fp4' is not one of fp32, bf16, fp8") for p in problems)
    assert any("algo.is_level" in p for p in problems)
    assert any("rollout.engines=0 must be a positive integer" in p for p in problems)


def test_hf_checkpoint_dims_drive_the_checks(tmp_path: Path):
    (tmp_path / "config.json").write_text('{"num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936}')
    (tmp_path / "tokenizer.json").write_text("{}")
    validate(load_config(["model=qwen2.5_0.5b", f"model.hf_path={tmp_path}", "trainer.tp=2"]))
    assert "trainer.tp=4 must divide the model's 14 attention heads" in _problems(
        ["model=qwen2.5_0.5b", f"model.hf_path={tmp_path}", "trainer.tp=4"])
    assert "has no config.json" in _problems(["model=qwen2.5_0.5b", f"model.hf_path={tmp_path / 'missing'}"])


def test_gsm8k_paths_fp8_on_cpu_and_staleness():
    msg = _problems(["data=gsm8k", "data.train_path=/no/such/file.jsonl", "trainer.precision=fp8",
                     "rollout.async_steps=2", "rollout.max_staleness=0"])
    assert "data.train_path='/no/such/file.jsonl' does not exist" in msg
    assert "fp8 needs TransformerEngine on a GPU" in msg
    assert "rollout.max_staleness=0 must be >= 1 with rollout.async_steps=2" in msg
    assert "rollout.max_staleness" not in _problems(["data=gsm8k", "data.train_path=/no/such/file.jsonl",
                                                     "rollout.async_steps=3", "rollout.max_staleness=1"])


def test_more_demonstrations_than_synthetic_problems_is_refused():
    msg = _problems(["data.synthetic.train_size=100", "experiment.warmup_demos=101"])
    assert "experiment.warmup_demos=101 exceeds data.synthetic.train_size=100" in msg
    validate(load_config(["data.synthetic.train_size=100", "experiment.warmup_demos=100"]))


def test_distributed_optimizer_is_accepted_and_its_cpu_offload_needs_it_and_a_gpu():
    validate(load_config(["trainer.use_distributed_optimizer=true", "trainer.dp=2"]))
    msg = _problems(["trainer.offload.optimizer_cpu=true", "trainer.device=cpu"])
    assert "trainer.offload.optimizer_cpu=true keeps the optimizer in host memory" in msg and "runs on CPU" in msg
    assert "set trainer.use_distributed_optimizer=true with it" in msg
    for trainer in ("gpu_bf16", "gpu_fp8"):
        assert load_config([f"trainer={trainer}"]).trainer.use_distributed_optimizer is False


def test_colocated_handoff_refuses_async_rollouts():
    msg = _problems(["cluster.placement=colocated", "rollout.async_steps=1"])
    assert "rollout.async_steps=1" in msg and "cluster.colocated_memory=resident" in msg
    validate(load_config(["cluster.placement=colocated", "rollout.async_steps=1", "cluster.colocated_memory=resident"]))
    validate(load_config(["cluster.placement=colocated"]))


def test_cli_prints_resolved_job_config(capsys):
    assert main(["train", "--cfg", "job", "trainer.tp=2"]) == 0
    out = capsys.readouterr().out
    assert "trainer:" in out and "tp: 2" in out and "experiment:" in out


def test_cli_reports_bad_override_and_bad_value(capsys):
    assert main(["train", "--cfg", "job", "trainer.tpp=3"]) == 2
    assert capsys.readouterr().err.strip() == (
        "miles-lite train: configuration error: unknown key trainer.tpp (trainer has no field 'tpp'); "
        "closest known: trainer.tp, trainer.pp, trainer.ep")
    # Also in the + form, which Hydra would add to the typed config as an attribute nothing reads.
    assert main(["train", "--cfg", "job", "+rollout.engins=2"]) == 2
    assert "unknown key rollout.engins (rollout has no field 'engins'); closest known: rollout.engines" in \
        capsys.readouterr().err
    assert main(["train", "--cfg", "job", "nonexistent.key=1"]) == 2
    assert "unknown key nonexistent.key (there is no section 'nonexistent'); known sections: algo," in \
        capsys.readouterr().err
    # Inside a free-form mapping any key goes, with + as Hydra wants for a new one.
    assert main(["train", "--cfg", "job", "rollout.sglang_args.mem_fraction_static=0.5"]) == 2
    assert "add it with +rollout.sglang_args.mem_fraction_static=<value>" in capsys.readouterr().err
    assert main(["train", "--cfg", "job", "+rollout.sglang_args.mem_fraction_static=0.5"]) == 0
    capsys.readouterr()
    assert main(["train", "--cfg", "job", "trainer.tp=3"]) == 2
    assert "must divide" in capsys.readouterr().err
    # A value of the wrong type names the field, the value and the type (Hydra says only "Error merging override").
    assert main(["train", "--cfg", "job", "trainer.tp=abc"]) == 2
    assert capsys.readouterr().err.strip() == ("miles-lite train: configuration error: trainer.tp='abc' is not of "
                                               "type int; set trainer.tp=<int>")


def test_cli_help_and_argument_errors(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    assert "presample" in capsys.readouterr().out
    with pytest.raises(SystemExit) as info:
        main(["trian"])
    assert info.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_schema_fields_have_defaults():
    # Every field needs a default so that `miles-lite train` with no arguments works.
    for group in GROUPS:
        cls = type(getattr(MilesConfig(), group))
        for f in dataclasses.fields(cls):
            assert f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING, f.name


def test_every_field_is_range_checked_at_start(capsys):
    # Each used to pass validation and fail later inside a rank, or at the final save, naming no field.
    bad = ["trainer.lr=-1", "rollout.temperature=-1", "fault_tolerance.health_interval_s=0", "checkpoint.keep_last=-1",
           "trainer.adam_beta2=1.5", "observability.metrics_port=70000"]
    assert main(["train", "--cfg", "job", *bad]) == 2
    err = capsys.readouterr().err
    assert "trainer.lr=-1.0 is out of range; set trainer.lr to a finite number > 0" in err
    assert "rollout.temperature=-1.0 is out of range; set rollout.temperature to a finite number >= 0" in err
    assert "fault_tolerance.health_interval_s=0.0 is out of range; set fault_tolerance.health_interval_s to a " \
           "finite number > 0" in err
    assert "checkpoint.keep_last=-1 is out of range; set checkpoint.keep_last to an integer >= 0" in err
    assert "trainer.adam_beta2=1.5 is out of range" in err and "observability.metrics_port=70000" in err
    for value in ("nan", "inf", "-inf"):  # NaN and infinities are outside every range
        assert main(["train", "--cfg", "job", f"rollout.temperature={value}"]) == 2
        assert f"rollout.temperature={float(value)!r} is out of range" in capsys.readouterr().err
    # The ranges live in the schema: every numeric field of the defaults lies inside its own.
    from miles_lite.config.schema import MilesConfig, ranges

    table = ranges(MilesConfig())
    assert {"trainer.lr", "rollout.temperature", "checkpoint.keep_last",
            "fault_tolerance.health_interval_s"} <= set(table)



def test_strict_bounds_refuse_their_endpoint() -> None:
    # `gt` / `lt` exclude the bound itself: a learning rate of 0 or an Adam beta of 1 is refused, with the
    # strict comparison named; the values just inside pass.
    from miles_lite.config.schema import ranges

    table = ranges(MilesConfig())
    assert table["trainer.lr"].gt == 0 and table["trainer.adam_beta1"].lt == 1
    for field_name, bad, good in (("lr", 0.0, 1e-9), ("adam_beta1", 1.0, 0.999)):
        cfg = MilesConfig()
        setattr(cfg.trainer, field_name, bad)
        with pytest.raises(ConfigError) as err:
            validate(cfg)
        op = "> 0" if field_name == "lr" else "< 1"
        assert f"trainer.{field_name}={bad!r} is out of range" in str(err.value) and op in str(err.value)
        setattr(cfg.trainer, field_name, good)
        validate(cfg)

def test_schema_choices_match_the_algorithms_they_name() -> None:
    # Validation reads allowed values from the schema; the algorithms parse the same strings into their enums.
    from miles_lite.algo.advantages import AdvantageEstimator
    from miles_lite.algo.losses import AggMode, KLEstimator, PolicyLossType
    from miles_lite.algo.mismatch import ISLevel, ISMode
    from miles_lite.config.schema import choices

    allowed = {k: set(v) for k, v in choices(MilesConfig()).items()}
    assert allowed["algo.advantage_estimator"] == {e.value for e in AdvantageEstimator}
    assert allowed["algo.agg_mode"] == {e.value for e in AggMode}
    assert allowed["algo.policy_loss"] == {e.value for e in PolicyLossType}
    assert allowed["algo.is_mode"] == {e.value for e in ISMode}
    assert allowed["algo.is_level"] == {e.value for e in ISLevel} | {"none"}
    assert allowed["algo.kl_estimator"] <= {e.value for e in KLEstimator}
    assert allowed["trainer.moe_token_dispatcher"] == {"auto", "alltoall", "allgather"}
    assert allowed["weight_sync.lora"] == {"adapter", "merged", "tensors"}
    assert allowed["rollout.plugin_pool"] == {"threads", "processes"}
    assert allowed["rollout.session_divergence"] == {"refuse", "branch"}
    assert allowed["trainer.offload.when"] == {"always", "needed"}
    assert len(allowed) == 29


def test_a_value_outside_the_schema_choices_names_field_and_choices() -> None:
    cfg = MilesConfig()
    cfg.rollout.backend = "vllm"
    cfg.trainer.lr_schedule = "step"
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    text = str(err.value)
    assert "rollout.backend='vllm' is not one of reference, sglang" in text
    assert "trainer.lr_schedule='step' is not one of constant, cosine, linear" in text


def test_trainer_world_size_is_tp_dp_pp() -> None:
    cfg = MilesConfig()
    cfg.trainer.tp, cfg.trainer.dp, cfg.trainer.pp = 2, 3, 1
    assert cfg.trainer.world_size == 6


@pytest.mark.parametrize("extra", [["rollout.environment=calculator"], ["rollout.stop=['</answer>']"]])
def test_stop_strings_into_sglang_need_its_tokenizer(extra):
    # SGLang's scheduler decodes the output tail to match stop strings; with skip_tokenizer_init it has nothing
    # to decode with and fails on the first request.
    sglang = ["rollout=sglang", "trainer=gpu_bf16", "weight_sync.transport=disk", *extra]
    assert "rollout.sglang_args.skip_tokenizer_init=false" in _problems(sglang)
    try:
        validate(load_config([*sglang, "rollout.sglang_args.skip_tokenizer_init=false"]))
    except ConfigError as err:
        assert "skip_tokenizer_init" not in str(err)


def test_top_k_zero_is_refused_before_any_engine_starts():
    assert "rollout.top_k=0 samples from no token" in _problems(["rollout.top_k=0"])


def test_api_key_file_is_checked_with_the_other_fields(tmp_path: Path):
    from miles_lite.net.api_key import write_key_file

    loose = tmp_path / "loose"
    loose.write_text("k" * 32)
    loose.chmod(0o644)
    cfg = load_config([f"cluster.api_key_file={loose}", "rollout.top_k=0"])
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    assert any(p.startswith("cluster.api_key_file:") and "chmod 600" in p for p in err.value.problems)
    assert any(p.startswith("rollout.top_k") for p in err.value.problems)
    good = write_key_file(tmp_path / "good", "k" * 32)
    validate(load_config([f"cluster.api_key_file={good}"]))
