"""What a resume may change: field kinds, the comparison with a checkpoint's recorded configuration and
data identity, and the run directory's record of every start's configuration."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
import torch

from miles_lite.checkpoint import AsyncCheckpointer, CheckpointPayload, GlobalPiece
from miles_lite.config import to_yaml
from miles_lite.config.changes import UNSET, Change, change_kind, config_changes, config_tree
from miles_lite.config.schema import CheckpointConfig, DataConfig, MilesConfig, SyntheticDataConfig
from miles_lite.data.arithmetic import ArithmeticSpec, write_dataset
from miles_lite.data.identity import IDENTITY_BY_SOURCE, data_identity, same_data
from miles_lite.run.record import ResumeRefused, plan_resume, record_start_config


@pytest.mark.parametrize(("field", "kind"), [
    ("model.shape.hidden_size", "refused"), ("model.vocab_size", "refused"), ("model.tokenizer_path", "refused"),
    ("data.train_path", "data"), ("data.source", "data"), ("data.synthetic.seed", "data"),
    ("data.synthetic.eval_size", "applied"), ("data.shuffle_seed", "spent"), ("data.presample.k", "spent"),
    ("experiment.warmup_steps", "spent"), ("experiment.warmup", "spent"), ("experiment.steps", "applied"),
    ("trainer.lr", "applied"), ("trainer.tp", "applied"), ("rollout.group_size", "applied"),
    ("rollout.sglang_args.chunked_prefill_size", "applied"), ("observability.wandb", "applied"),
    ("experiment.output_dir", "ignored"), ("checkpoint.resume", "ignored"), ("checkpoint.allow_data_change", "ignored"),
])
def test_each_field_has_a_kind(field: str, kind: str) -> None:
    assert change_kind(field) == kind


def test_changes_open_nested_and_pass_through_fields() -> None:
    old = {"trainer": {"lr": 1e-3, "transformer": {}}, "rollout": {"sglang_args": {"a": 1}, "stop": ["x"]}}
    new = {"trainer": {"lr": 2e-3, "transformer": {"recompute": "full"}}, "rollout": {"sglang_args": {"a": 1},
                                                                                        "stop": ["x", "y"]}}
    changes = config_changes(old, new)
    assert changes == [Change("rollout.stop", ["x"], ["x", "y"]), Change("trainer.lr", 1e-3, 2e-3),
                       Change("trainer.transformer", {}, UNSET), Change("trainer.transformer.recompute", UNSET, "full")]
    assert changes[1].describe() == "trainer.lr 0.001 -> 0.002"
    assert changes[3].as_json() == {"field": "trainer.transformer.recompute", "from": None, "to": "full"}
    assert config_changes({"a": 1}, {"a": 1.0}) == []  # an int written as a float is the same value


def _checkpoint(root: Path, cfg: MilesConfig, step: int = 3, record: bool = True) -> Path:
    meta = {"weight_version": step}
    if record:
        meta.update(run_config=config_tree(cfg), data_identity=data_identity(cfg.data))
    saver = AsyncCheckpointer(root)
    saver.save(step, CheckpointPayload(pieces=[GlobalPiece.whole("w", torch.ones(2))], shared={}, meta=meta))
    saver.close()
    return root / f"step_{step:08d}"


def _with(cfg: MilesConfig, **groups: object) -> MilesConfig:
    return dataclasses.replace(cfg, **groups)


def test_an_unchanged_resume_lists_nothing(tmp_path: Path) -> None:
    cfg = MilesConfig()
    plan = plan_resume(cfg, _checkpoint(tmp_path, cfg))
    assert plan.recorded and plan.step == 3 and plan.changes == [] and plan.line() is None
    moved = _with(cfg, experiment=dataclasses.replace(cfg.experiment, output_dir="/elsewhere", run_name="r2"),
                  checkpoint=CheckpointConfig(resume=str(tmp_path)))
    assert plan_resume(moved, _checkpoint(tmp_path, cfg)).changes == []


def test_refused_changes_are_listed_all_at_once_with_the_recorded_value(tmp_path: Path) -> None:
    cfg = MilesConfig()
    ckpt = _checkpoint(tmp_path, cfg)
    shape = dataclasses.replace(cfg.model.shape, hidden_size=128, num_layers=3)
    data = dataclasses.replace(cfg.data, synthetic=dataclasses.replace(cfg.data.synthetic, seed=5))
    asked = _with(cfg, model=dataclasses.replace(cfg.model, shape=shape, vocab_size=1024), data=data,
                  trainer=dataclasses.replace(cfg.trainer, lr=1.0))
    with pytest.raises(ResumeRefused) as refused:
        plan_resume(asked, ckpt)
    text = str(refused.value)
    assert f"checkpoint {ckpt} (step 3) cannot resume" in text
    for line in ("model.shape.hidden_size: the checkpoint has 64 (asked: 128)",
                 "model.shape.num_layers: the checkpoint has 2 (asked: 3)",
                 "model.vocab_size: the checkpoint has 512 (asked: 1024)",
                 "data (data.synthetic.seed): the checkpoint's prompt cursor indexes synthetic problems"):
        assert line in text
    assert "seed=0) (asked: synthetic problems" in text and "checkpoint.allow_data_change=true" in text
    assert "start a new run" in text and "checkpoint.resume=none" in text
    assert "trainer.lr" not in text  # an applicable change is not refused


def test_applicable_changes_are_applied_and_spent_ones_named(tmp_path: Path) -> None:
    cfg = MilesConfig()
    ckpt = _checkpoint(tmp_path, cfg)
    asked = _with(cfg, trainer=dataclasses.replace(cfg.trainer, lr=2e-6, tp=2),
                  experiment=dataclasses.replace(cfg.experiment, steps=40, warmup_steps=7))
    plan = plan_resume(asked, ckpt)
    assert [c.field for c in plan.applied] == ["experiment.steps", "trainer.lr", "trainer.tp"]
    assert [c.field for c in plan.spent] == ["experiment.warmup_steps"]
    line = plan.line()
    assert line is not None and line.startswith("resumed at step 3 with changed settings: applied experiment.steps "
                                                "20 -> 40, trainer.lr 1e-06 -> 2e-06, trainer.tp 1 -> 2; no effect")
    assert plan.as_json()["applied"][1] == {"field": "trainer.lr", "from": 1e-06, "to": 2e-06}


def test_other_data_is_taken_with_allow_data_change_and_the_cursor_restarts(tmp_path: Path) -> None:
    cfg = MilesConfig()
    ckpt = _checkpoint(tmp_path, cfg)
    data = dataclasses.replace(cfg.data, shuffle_seed=9, synthetic=SyntheticDataConfig(train_size=50))
    plan = plan_resume(_with(cfg, data=data, checkpoint=CheckpointConfig(allow_data_change=True)), ckpt)
    assert plan.data_changed
    assert [c.field for c in plan.applied] == ["data.shuffle_seed", "data.synthetic.train_size"]
    assert "the prompt cursor restarts on the new data (synthetic problems (train_size=50" in (plan.line() or "")


def test_a_moved_file_with_the_same_content_is_the_same_data(tmp_path: Path) -> None:
    first = write_dataset(tmp_path / "a.jsonl", 8, ArithmeticSpec(seed=1))
    cfg = _with(MilesConfig(), data=DataConfig(source="gsm8k", train_path=str(first)))
    ckpt = _checkpoint(tmp_path / "ckpt", cfg)
    moved = tmp_path / "b.jsonl"
    shutil.copy(first, moved)
    plan = plan_resume(_with(cfg, data=DataConfig(source="gsm8k", train_path=str(moved))), ckpt)
    assert not plan.data_changed and [c.field for c in plan.applied] == ["data.train_path"]
    write_dataset(first, 8, ArithmeticSpec(seed=2))  # same path, other problems
    with pytest.raises(ResumeRefused, match=r"data \(the data's content\): .* indexes file .*a\.jsonl"):
        plan_resume(cfg, ckpt)


def test_a_checkpoint_without_a_record_is_resumed_without_comparison(tmp_path: Path) -> None:
    cfg = MilesConfig()
    ckpt = _checkpoint(tmp_path, cfg, record=False)  # an older checkpoint, or weights converted from HF
    other = _with(cfg, model=dataclasses.replace(cfg.model, vocab_size=1024))
    plan = plan_resume(other, ckpt)
    assert not plan.recorded and plan.changes == [] and plan.step == 3


def test_data_identity_by_source(tmp_path: Path) -> None:
    assert set(IDENTITY_BY_SOURCE) == {"gsm8k", "records", "synthetic"}
    a = data_identity(DataConfig(synthetic=SyntheticDataConfig(seed=1)))
    assert a["source"] == "synthetic" and a["key"]["seed"] == 1 and a["key"]["ops"] == ["+", "-", "*"]
    assert same_data(a, data_identity(DataConfig(synthetic=SyntheticDataConfig(seed=1, eval_size=3))))
    assert not same_data(a, data_identity(DataConfig(synthetic=SyntheticDataConfig(seed=2))))
    path = write_dataset(tmp_path / "t.jsonl", 4, ArithmeticSpec(seed=1))
    f = data_identity(DataConfig(source="gsm8k", train_path=str(path)))
    assert f["path"] == str(path.resolve()) and f["key"]["bytes"] == path.stat().st_size
    assert not same_data(a, f)
    with pytest.raises(ValueError, match="data.source='nope' has no data identity"):
        data_identity(DataConfig(source="nope"))


def test_the_run_directory_keeps_every_starts_configuration(tmp_path: Path) -> None:
    cfg = MilesConfig()
    first = to_yaml(cfg)
    assert record_start_config(tmp_path, first, 0) is None
    assert (tmp_path / "config.yaml").read_text() == "# miles-lite: the configuration of the start at step 0\n" + first
    assert record_start_config(tmp_path, first, 5) is None  # the same configuration goes on: left as it is
    assert (tmp_path / "config.yaml").read_text().startswith("# miles-lite: the configuration of the start at step 0")
    second = to_yaml(_with(cfg, trainer=dataclasses.replace(cfg.trainer, lr=0.5)))
    kept = record_start_config(tmp_path, second, 5)
    assert kept == tmp_path / "config.from_step_0.yaml" and kept.read_text().endswith(first)
    assert (tmp_path / "config.yaml").read_text().startswith("# miles-lite: the configuration of the start at step 5")
    assert record_start_config(tmp_path, first, 9) == tmp_path / "config.from_step_5.yaml"
    (tmp_path / "config.yaml").write_text("legacy: true\n")  # written before starts were recorded
    assert record_start_config(tmp_path, second, 12) == tmp_path / "config.from_step_unknown.yaml"


def test_the_calculator_tool_on_a_random_model_is_a_tokenizer_change(tmp_path: Path) -> None:
    cfg = MilesConfig()
    ckpt = _checkpoint(tmp_path, cfg)
    with pytest.raises(ResumeRefused, match="rollout.environment: the checkpoint has null .asked: calculator.; the "
                                            "offline tokenizer's calculator tags"):
        plan_resume(_with(cfg, rollout=dataclasses.replace(cfg.rollout, environment="calculator")), ckpt)
    plugin = _with(cfg, rollout=dataclasses.replace(cfg.rollout, environment="tools:Env"))
    assert [c.field for c in plan_resume(plugin, ckpt).applied] == ["rollout.environment"]
