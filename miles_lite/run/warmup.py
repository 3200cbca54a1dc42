"""Before RL: the warm-up (SFT on tag-format reference solutions, or on-policy distillation from a teacher)
and the presample filter. Each warm-up step appends its stats to `warmup.jsonl` in the run directory."""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Callable, Sequence
from typing import Any

from miles_lite.data.gsm8k import MathProblem
from miles_lite.data.source import PromptSource
from miles_lite.formats.files import append_line, write_atomic
from miles_lite.rollout.presample import presample
from miles_lite.run.rl_batch import distill_batch

# experiment.warmup_stop_loss compares the mean loss of this many steps (one batch's loss is noisy).
STOP_LOSS_WINDOW = 10


def _record(system: Any, mode: str, step: int, stats: dict[str, float]) -> None:
    """One line of `warmup.jsonl` for warm-up step `step` (counted from 1, as the console counts)."""
    append_line(system.run_dir / "warmup.jsonl", json.dumps({"mode": mode, "step": step, **stats}))


def _should_log(step: int, steps: int) -> bool:
    return step % max(steps // 5, 1) == 0 or step == steps - 1


def _never() -> bool:
    return False


def run_warmup(system: Any, problems: Sequence[MathProblem], io: Any,
               should_stop: Callable[[], bool] = _never, data: PromptSource | None = None) -> bool:
    """`experiment.warmup`: `sft` (see `run_sft`), `opd` (see `run_opd`) or `none`.

    `should_stop` is asked after every step; returns False when it cut the warm-up short. With
    `experiment.warmup_exclude_from_rl`, the questions SFT trained on are left out of `data`, the RL
    prompt stream (RL on questions whose reference solutions were just learnt measures recall).
    """
    exp = system.cfg.experiment
    if exp.warmup == "sft":
        seen: set[int] = set()
        finished = run_sft(system, problems, io, should_stop, seen)
        if finished and exp.warmup_exclude_from_rl and data is not None:
            exclude_sft_questions(data, seen, io)
        return finished
    if exp.warmup == "opd":
        return run_opd(system, problems, io, should_stop)
    if exp.warmup != "none":
        raise ValueError(f"experiment.warmup={exp.warmup!r} is not one of sft, opd, none")
    return True


def exclude_sft_questions(data: PromptSource, seen: set[int], io: Any) -> None:
    """Leave the questions SFT trained on out of the RL stream."""
    if not set(data.active) - seen:
        raise ValueError(
            f"the SFT warm-up trained on every one of the {len(data.active):,} RL questions, so "
            "experiment.warmup_exclude_from_rl=true leaves none: lower experiment.warmup_steps or "
            "experiment.warmup_batch_size, add training data, or set experiment.warmup_exclude_from_rl=false")
    data.exclude(sorted(seen))
    io.log(f"sft warm-up used {len(seen):,} questions; the RL stream keeps the other {len(data.active):,} "
           "(experiment.warmup_exclude_from_rl=false keeps them all)")


def _stopped(io: Any, mode: str, step: int, steps: int) -> bool:
    io.log(f"{mode} warm-up stopped after step {step + 1}/{steps}")
    return False


def run_sft(system: Any, problems: Sequence[MathProblem], io: Any, should_stop: Callable[[], bool] = _never,
            seen: set[int] | None = None) -> bool:
    """`warmup_steps` cross-entropy steps on (prompt, reference solution) pairs at `experiment.warmup_lr`.

    The worklog's lesson: RL from a model that never emits the answer format has no reward signal;
    a short SFT teaches the format so RL can work on correctness. The pairs come from the first
    `experiment.warmup_demos` problems (all when 0). `seen` collects the indices of the questions it
    trained on.
    """
    exp = system.cfg.experiment
    pool = demo_count(exp.warmup_demos, len(problems))
    rng = random.Random(exp.seed)
    loss = float("nan")
    recent: list[float] = []
    for step in range(exp.warmup_steps):
        picked = rng.sample(range(pool), min(exp.warmup_batch_size, pool))
        if seen is not None:
            seen.update(picked)
        batch = system.encoder.sft_batch([problems[i] for i in picked])
        stats = system.trainer.sft_step(batch, lr=exp.warmup_lr)
        loss = stats.get("loss/sft", stats.get("loss/total", loss))
        guard = {k: stats[k] for k in ("update_ratio", "update_ratio_bound", "skipped") if k in stats}
        _record(system, "sft", step + 1, {"loss": loss, **guard})
        if _should_log(step, exp.warmup_steps):
            io.log(f"sft warm-up {step + 1}/{exp.warmup_steps}: loss {loss:.3f}")
        recent = [*recent[-(STOP_LOSS_WINDOW - 1):], loss]
        if (exp.warmup_stop_loss is not None and len(recent) == STOP_LOSS_WINDOW
                and sum(recent) / STOP_LOSS_WINDOW < exp.warmup_stop_loss):
            io.log(f"sft warm-up {step + 1}/{exp.warmup_steps}: mean loss of the last {STOP_LOSS_WINDOW} steps "
                   f"{sum(recent) / STOP_LOSS_WINDOW:.3f} < experiment.warmup_stop_loss={exp.warmup_stop_loss}; done")
            return True
        if should_stop():
            return _stopped(io, "sft", step, exp.warmup_steps)
    return True


def demo_count(demos: int, n_problems: int) -> int:
    """How many problems the SFT warm-up may take reference solutions from (`experiment.warmup_demos`)."""
    if demos > n_problems:
        raise ValueError(f"experiment.warmup_demos={demos} asks for more demonstrations than the {n_problems:,} "
                         "training problems hold: lower it, or set 0 to use every problem")
    return demos or n_problems


def run_opd(system: Any, problems: Sequence[MathProblem], io: Any, should_stop: Callable[[], bool] = _never) -> bool:
    """`warmup_steps` steps of on-policy distillation from the teacher at `experiment.teacher_path`.

    Each step the engines sample one completion from the student for each of `warmup_batch_size`
    questions; the teacher scores every sampled token (its vocabulary, which may carry extra padding
    rows, trimmed to the student's); one optimizer step with zero advantages then trains the student
    on the distillation term alone (weight `algo.distill_coef`, per-token reward = teacher minus
    student log-prob, i.e. the reverse KL); and the new weights are pushed, so the next step samples
    on-policy again. Steps use the RL optimizer and LR schedule (`trainer.lr`). The teacher must
    share the student's tokenizer.
    """
    cfg = system.cfg
    exp = cfg.experiment
    if not exp.teacher_path:
        raise ValueError("experiment.warmup=opd needs experiment.teacher_path=<HF checkpoint directory of the "
                         "teacher> (same tokenizer as the student); or use experiment.warmup=sft")
    if cfg.algo.distill_coef <= 0:
        raise ValueError(f"experiment.warmup=opd needs algo.distill_coef > 0, got {cfg.algo.distill_coef}; "
                         "set e.g. algo.distill_coef=1.0")
    rng = random.Random(exp.seed)
    for step in range(exp.warmup_steps):
        picked = rng.sample(range(len(problems)), min(exp.warmup_batch_size, len(problems)))
        groups = system.rollout.generate_groups(system.encoder.prompt_specs([(i, problems[i]) for i in picked]), 1)
        batch = distill_batch(groups)
        if batch is None:
            io.log(f"opd warm-up {step + 1}/{exp.warmup_steps}: every completion was empty; step skipped")
            if should_stop():
                return _stopped(io, "opd", step, exp.warmup_steps)
            continue
        batch = dataclasses.replace(batch, teacher_logprobs=system.trainer.compute_logprobs(batch, model="teacher"))
        stats = system.trainer.train_step(batch)
        io.report_sync(*system.push_weights(0))  # still before the first RL step
        kl = stats.get("distill/reverse_kl", float("nan"))
        _record(system, "opd", step + 1, {"reverse_kl": kl, "loss": stats.get("loss/total", float("nan")),
                                      "response_tokens": stats.get("response_tokens", 0.0)})
        if _should_log(step, exp.warmup_steps):
            io.log(f"opd warm-up {step + 1}/{exp.warmup_steps}: reverse KL to the teacher {kl:.3f} nats/token")
        if should_stop():
            return _stopped(io, "opd", step, exp.warmup_steps)
    return True


def presample_filter(system: Any, data: PromptSource, problems: Sequence[MathProblem], io: Any,
                     context: Any = None) -> None:
    """Sample k completions per training question; keep only questions that are neither all wrong nor all right.

    Such questions give zero-signal groups (every completion scores the same), so they cost rollout time
    and teach nothing. Prints the pass@k table and the worklog-style counts line. `context`: the trainer
    state records' reward plug-ins see (a `RewardContext`).
    """
    pre = system.cfg.data.presample
    if not pre.enabled:
        return
    subset = list(problems[: pre.max_questions] if pre.max_questions else problems)
    manager = system.rollout.manager
    enc = system.encoder
    report = system.loop_thread.run(presample(manager, subset, enc.render, enc.encode, pre, system.sampling,
                                              reward_set=system.reward_set, context=context))
    io.log(f"presample pass@k ({report.k} samples, {len(subset):,} questions):\n{report.table()}")
    io.log(f"presample ({report.scoring}): {report.summary_line()}")
    write_atomic(system.run_dir / "presample.json", report.to_json())
    if report.kept_indices:
        data.keep_only(report.kept_indices)
    else:
        io.log("presample kept no question; training on the unfiltered data")
