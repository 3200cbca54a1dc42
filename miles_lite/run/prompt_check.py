"""Before any work: does every prompt fit? Each prompt of the training data, the held-out problems and the
evaluation sets is rendered and tokenised as the run will, and checked against `data.max_prompt_tokens` and
the model's context together with the tokens generated for it (`rollout.max_new_tokens`, the presample's or
an evaluation set's own budget); each SFT demonstration (prompt and reference response) against the context.
Offenders are named by file and line with their length (the first few, and how many in all), with the fix,
and the run stops with exit code 2 before it has a directory. Without this a prompt too long for the engine
failed mid-run, and a very long one made the warm-up's attention allocate terabytes.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from miles_lite.config.schema import MilesConfig
from miles_lite.data.encoding import PromptEncoder
from miles_lite.data.gsm8k import DatasetError
from miles_lite.data.problems import EvalSet
from miles_lite.run.warmup import demo_count

# Offending prompts named in the message; the rest are counted.
SHOWN = 5


def _where(item: Any, field: str, index: int) -> str:
    return getattr(item, "where", "") or f"{field} item {index} (0-based)"


class _Findings:
    """Problems found, grouped so that one message names the first few of each kind and counts the rest."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.more = 0

    def add(self, line: str) -> None:
        if len(self.lines) < SHOWN:
            self.lines.append(line)
        else:
            self.more += 1


def _check_prompts(findings: _Findings, lengths: Sequence[int], items: Sequence[Any], field: str, max_prompt: int,
                   budget: int, budget_key: str, context: int | None, context_from: str) -> set[int]:
    """Add a line per prompt over `data.max_prompt_tokens` or the context; the indices of those prompts."""
    bad = set()
    for i, (n, item) in enumerate(zip(lengths, items, strict=True)):
        where = _where(item, field, i)
        if n > max_prompt:
            findings.add(f"{where}: the prompt has {n:,} tokens, over data.max_prompt_tokens={max_prompt:,}; "
                         "shorten it (or drop the record) or raise data.max_prompt_tokens")
        elif context is not None and n + budget > context:
            findings.add(f"{where}: the prompt has {n:,} tokens, which with {budget_key}={budget:,} generated "
                         f"need {n + budget:,} positions, over the model's context of {context:,} ({context_from}); "
                         f"shorten it (or drop the record) or lower {budget_key}")
        else:
            continue
        bad.add(i)
    return bad


def check_prompt_lengths(cfg: MilesConfig, tokenizer: Any, context: int | None, context_from: str,
                         train: Sequence[Any], held_out: Sequence[Any], eval_sets: Iterable[EvalSet]) -> None:
    """Raise DatasetError naming the prompts (and SFT demonstrations) that do not fit; see the module docstring."""
    from miles_lite.run.model_assets import run_chat_template

    # The encoder the run's roles use: agent runs render (and train on) conversations with the sessions' template.
    encoder = PromptEncoder(tokenizer, cfg.data.prompt_template, tool_solutions=cfg.rollout.environment == "calculator",
                            chat_template=run_chat_template(cfg, tokenizer),
                            raw_prompts=not cfg.data.chat_template)
    rollout, max_prompt = cfg.rollout, cfg.data.max_prompt_tokens
    findings = _Findings()
    budget, budget_key = rollout.max_new_tokens, "rollout.max_new_tokens"
    pre = cfg.data.presample
    if pre.enabled and pre.max_new_tokens is not None and pre.max_new_tokens > budget:
        budget, budget_key = pre.max_new_tokens, "data.presample.max_new_tokens"
    if context is not None and budget >= context:
        raise DatasetError(f"{budget_key}={budget:,} leaves no room for a prompt in the model's context of "
                           f"{context:,} ({context_from}); lower {budget_key}")
    train_lengths = encoder.prompt_lengths(train)
    too_long = _check_prompts(findings, train_lengths, train, "data.train_path", max_prompt, budget, budget_key,
                              context, context_from)
    _check_prompts(findings, encoder.prompt_lengths(held_out), held_out, "held-out problems", max_prompt,
                   rollout.max_new_tokens, "rollout.max_new_tokens", context, context_from)
    for s in eval_sets:
        set_budget = s.cfg.max_new_tokens or rollout.max_new_tokens
        key = f"data.eval_sets.{s.name}.max_new_tokens" if s.cfg.max_new_tokens else "rollout.max_new_tokens"
        _check_prompts(findings, encoder.prompt_lengths(s.items), s.items, f"data.eval_sets.{s.name}", max_prompt,
                       set_budget, key, context, context_from)
    if cfg.experiment.warmup == "sft" and train and context is not None:
        pool = [i for i in range(demo_count(cfg.experiment.warmup_demos, len(train))) if i not in too_long]
        for i, n in zip(pool, encoder.sft_lengths([train[i] for i in pool]), strict=True):
            if n > context:
                findings.add(f"{_where(train[i], 'data.train_path', i)}: the SFT warm-up's prompt and reference "
                             f"response have {n:,} tokens, over the model's context of {context:,} ({context_from}); "
                             "shorten the response (or drop the record) or set experiment.warmup=none")
    if findings.lines:
        more = f"; and {findings.more:,} more" if findings.more else ""
        raise DatasetError("; ".join(findings.lines) + more)


def check_prompts_fit(cfg: MilesConfig, train: Sequence[Any], held_out: Sequence[Any],
                      eval_sets: Iterable[EvalSet]) -> None:
    """`check_prompt_lengths` with the run's own tokenizer and model context."""
    from miles_lite.run.dir_probe import OutputDirError
    from miles_lite.run.model_assets import model_context, run_tokenizer

    try:
        tokenizer = run_tokenizer(cfg)
    except OSError as err:  # the random model's tokenizer is cached under experiment.output_dir
        raise OutputDirError(f"experiment.output_dir={cfg.experiment.output_dir!r}: cannot write its tokenizer cache "
                             f"({err.strerror or err}); set experiment.output_dir to a writable directory") from None
    context, context_from = model_context(cfg)
    check_prompt_lengths(cfg, tokenizer, context, context_from, train, held_out, eval_sets)
