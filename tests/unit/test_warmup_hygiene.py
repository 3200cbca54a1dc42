"""Warm-up hygiene: SFT questions out of the RL stream, the distillation weight after OPD, the worklog prompt."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from miles_lite.config.schema import MilesConfig
from miles_lite.data.arithmetic import generate_problems
from miles_lite.data.encoding import PromptEncoder
from miles_lite.data.prompts import WORKLOG_SYSTEM_PROMPT, render_prompt
from miles_lite.data.source import PromptSource
from miles_lite.run.rl_batch import rl_distill_coef
from miles_lite.run.warmup import run_warmup


class _Trainer:
    def __init__(self) -> None:
        self.batches: list[list[str]] = []

    def sft_step(self, batch: list[str], lr: float) -> dict[str, float]:
        self.batches.append(batch)
        return {"loss/sft": 1.0}


def _system(tmp_path: Path, exclude: bool, steps: int = 3, batch_size: int = 4) -> SimpleNamespace:
    cfg = MilesConfig()
    cfg.experiment.warmup, cfg.experiment.warmup_steps = "sft", steps
    cfg.experiment.warmup_batch_size, cfg.experiment.warmup_exclude_from_rl = batch_size, exclude
    encoder = SimpleNamespace(sft_batch=lambda problems: [p.question for p in problems])
    return SimpleNamespace(cfg=cfg, trainer=_Trainer(), run_dir=tmp_path, encoder=encoder)


@pytest.mark.parametrize("exclude", [True, False])
def test_sft_questions_leave_the_rl_stream_when_configured(tmp_path: Path, exclude: bool) -> None:
    problems = generate_problems(40)
    system, data = _system(tmp_path, exclude), PromptSource(problems, seed=0)
    run_warmup(system, problems, SimpleNamespace(log=lambda _: None), data=data)
    sft_questions = {q for batch in system.trainer.batches for q in batch}
    assert len(system.trainer.batches) == 3 and sft_questions
    rl_questions = {p.question for _, p in data.next_batch(len(data.active))}
    if exclude:
        assert not sft_questions & rl_questions and len(data.active) < len(problems)
    else:
        assert sft_questions <= rl_questions and len(data.active) == len(problems)


def test_excluding_every_question_names_the_fields(tmp_path: Path) -> None:
    problems = generate_problems(4)
    system = _system(tmp_path, exclude=True, steps=2, batch_size=4)
    with pytest.raises(ValueError, match="experiment.warmup_exclude_from_rl"):
        run_warmup(system, problems, SimpleNamespace(log=lambda _: None), data=PromptSource(problems, seed=0))


def test_a_later_filter_never_brings_excluded_questions_back() -> None:
    src = PromptSource(generate_problems(6), seed=0)
    src.exclude([0, 1])
    src.keep_only([1, 2, 3])
    assert sorted(src.active) == [2, 3]


def test_rl_distillation_weight_is_zero_after_opd_unless_set() -> None:
    cfg = MilesConfig()
    cfg.algo.distill_coef = 1.0
    assert rl_distill_coef(cfg) == 1.0  # no OPD warm-up: the configured weight throughout
    cfg.experiment.warmup = "opd"
    assert rl_distill_coef(cfg) == 0.0
    cfg.algo.rl_distill_coef = 0.25
    assert rl_distill_coef(cfg) == 0.25


def test_worklog_prompt_template_reaches_the_rendered_prompt() -> None:
    assert "\\boxed{}" in WORKLOG_SYSTEM_PROMPT and "<SOLUTION>72</SOLUTION>" in WORKLOG_SYSTEM_PROMPT
    cfg = MilesConfig()
    default = PromptEncoder(None, cfg.data.prompt_template).render("How many?")
    cfg.data.prompt_template = "worklog"
    worklog = PromptEncoder(None, cfg.data.prompt_template).render("How many?")
    assert WORKLOG_SYSTEM_PROMPT in worklog and WORKLOG_SYSTEM_PROMPT not in default
    assert worklog.endswith("User: How many?\nAssistant: ")
    with pytest.raises(ValueError, match="data.prompt_template"):
        render_prompt(None, "q", "fancy")


def test_sft_draws_only_from_the_first_warmup_demos_problems(tmp_path: Path) -> None:
    problems = generate_problems(40)
    system = _system(tmp_path, exclude=False, steps=20, batch_size=4)
    system.cfg.experiment.warmup_demos = 6
    data = PromptSource(problems, seed=0)
    run_warmup(system, problems, SimpleNamespace(log=lambda _: None), data=data)
    demos = {p.question for p in problems[:6]}
    sft_questions = {q for batch in system.trainer.batches for q in batch}
    assert sft_questions == demos  # 20 batches of 4 from 6 demonstrations reach every one, and only them
    assert len(data.active) == len(problems)  # RL keeps every question (answers only)


def test_more_demos_than_problems_names_the_field(tmp_path: Path) -> None:
    problems = generate_problems(5)
    system = _system(tmp_path, exclude=False)
    system.cfg.experiment.warmup_demos = 6
    with pytest.raises(ValueError, match="experiment.warmup_demos=6"):
        run_warmup(system, problems, SimpleNamespace(log=lambda _: None), data=PromptSource(problems, seed=0))


def test_sft_stops_once_its_recent_mean_loss_is_below_warmup_stop_loss(tmp_path: Path) -> None:
    class Falling(_Trainer):  # loss 1.0, 0.9, 0.8, ...: the mean of the last 10 steps is 0.25 after step 13
        def sft_step(self, batch: list[str], lr: float) -> dict[str, float]:
            self.batches.append(batch)
            return {"loss/sft": 1.0 - 0.1 * (len(self.batches) - 1)}

    problems = generate_problems(40)
    system = _system(tmp_path, False, steps=50)
    system.trainer, system.cfg.experiment.warmup_stop_loss = Falling(), 0.3
    lines: list[str] = []
    assert run_warmup(system, problems, SimpleNamespace(log=lines.append)) is True
    assert len(system.trainer.batches) == 13 and "warmup_stop_loss=0.3" in lines[-1]
    system = _system(tmp_path, False, steps=12)
    system.trainer = Falling()
    run_warmup(system, problems, SimpleNamespace(log=lines.append))
    assert len(system.trainer.batches) == 12
