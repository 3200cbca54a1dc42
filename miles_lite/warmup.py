"""Before RL: the supervised warm-up (SFT on tag-format reference solutions) and the presample filter."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from miles_lite.data.gsm8k import MathProblem
from miles_lite.data.source import PromptSource
from miles_lite.rollout.presample import presample


def run_warmup(system: Any, problems: Sequence[MathProblem], io: Any) -> None:
    """`experiment.warmup=sft`: `warmup_steps` cross-entropy steps on (prompt, reference solution) pairs.

    The worklog's lesson: RL from a model that never emits the answer format has no reward signal;
    a short SFT teaches the format so RL can work on correctness.
    """
    exp = system.cfg.experiment
    if exp.warmup == "none":
        return
    if exp.warmup == "opd":
        raise ValueError("experiment.warmup=opd needs a teacher engine: set experiment.teacher_path and use "
                         "algo.distill_coef during RL; use experiment.warmup=sft for the embedded default")
    rng = random.Random(exp.seed)
    loss = float("nan")
    for step in range(exp.warmup_steps):
        batch = system.sft_batch(rng.sample(list(problems), min(exp.warmup_batch_size, len(problems))))
        stats = system.trainer.sft_step(batch, lr=exp.warmup_lr)
        loss = stats.get("loss/sft", stats.get("loss/total", loss))
        if step % max(exp.warmup_steps // 5, 1) == 0 or step == exp.warmup_steps - 1:
            io.log(f"sft warm-up {step + 1}/{exp.warmup_steps}: loss {loss:.3f}")


def presample_filter(system: Any, data: PromptSource, problems: Sequence[MathProblem], io: Any) -> None:
    """Sample k completions per training question; keep only questions that are neither all wrong nor all right.

    Such questions give zero-signal groups (every completion scores the same), so they cost rollout time
    and teach nothing. Prints the pass@k table and the worklog-style counts line.
    """
    pre = system.cfg.data.presample
    if not pre.enabled:
        return
    subset = list(problems[: pre.max_questions] if pre.max_questions else problems)
    manager = system.rollout.manager
    report = system.loop_thread.run(presample(manager, subset, system.render, system.encode, pre, system.sampling))
    io.log(f"presample pass@k ({report.k} samples, {len(subset):,} questions):\n{report.table()}")
    io.log(f"presample ({report.scoring}): {report.summary_line()}")
    (system.run_dir / "presample.json").write_text(report.to_json())
    if report.kept_indices:
        data.keep_only(report.kept_indices)
    else:
        io.log("presample kept no question; training on the unfiltered data")
