"""Evaluation of a model, a checkpoint or a run through the rollout engines:

    miles-lite eval outputs/RUN                    the run's newest checkpoint, evaluated as the run evaluates
    miles-lite eval outputs/RUN dev.jsonl          ... on a file, read with the run's key mapping and rewards
    miles-lite eval outputs/RUN/checkpoints/step_00000050 sets
    miles-lite eval MODEL_DIR DATA                 DATA: a GSM8K .jsonl/.parquet file, or 'synthetic'
    miles-lite eval outputs/run/initial_model synthetic --n 64 --engines 2
    miles-lite eval MODEL_DIR sets data.source=records data.prompt_key=prompt rewards.set=exact_match \\
        '+data.eval_sets={dev: {path: dev.jsonl, k: 4, temperature: 1.0}}'

MODEL_OR_CKPT is a run directory, a checkpoint (`step_N`) or a directory of them, or an HF model directory
(`cli/eval_source.py`). A run or a checkpoint brings the configuration it trained with: the task (data source,
key mapping, prompt template, rewards, evaluation sets) is the run's unless an override says otherwise; an HF
directory starts from the project's defaults. Without DATA a run or checkpoint is evaluated as the run was
(its held-out problems, or for records its evaluation sets).

On math problems (GSM8K files, 'synthetic', a math run's held-out problems) it prints the worklog's baseline
table, greedy: right number anywhere, right number inside SOLUTION, exact tag format, right answer and exact
format, and how many answers had a SOLUTION block. With DATA 'sets' it evaluates the run's evaluation sets
(`data.eval_sets`, and `held_out` from `data.eval_path` for records) as training does: mean reward,
avg@k and pass@j each, scored by the reward set of `rewards.*`. A records file given as DATA is one
such set (greedy, k=1), named after the file.
"""

from __future__ import annotations

import argparse
import sys

# DATA naming the configured evaluation sets instead of a file.
SETS = "sets"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `miles-lite eval`."""
    parser.add_argument("model", metavar="MODEL_OR_CKPT",
                        help="a run directory, a checkpoint (step_N) or a directory of them, or an HF model directory")
    parser.add_argument("data", metavar="DATA", nargs="?", default=None,
                        help="GSM8K-format or records .jsonl/.parquet file, 'synthetic', or 'sets' (the configured "
                             "evaluation sets: data.eval_sets, and held_out from data.eval_path for records); "
                             "default for a run or checkpoint: what the run evaluated")
    parser.add_argument("--n", type=int, default=None, help="first N problems (default: all; synthetic: 64)")
    parser.add_argument("--engines", type=int, default=1, help="reference/SGLang engines to start (default 1)")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="tokens per answer (default: rollout's)")
    parser.add_argument("--log-dir", default="outputs/eval_logs", help="engine server logs")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="Hydra overrides, e.g. rollout=sglang")


def run(args: argparse.Namespace) -> int:
    """Start engines on the model, evaluate, print the tables; 2 on bad arguments or data."""
    import os
    import tempfile
    from pathlib import Path

    if args.data is not None and "=" in args.data and not os.path.exists(args.data):
        args.overrides, args.data = [args.data, *args.overrides], None  # an override, not DATA
    if args.data not in (None, SETS, "synthetic") and not os.path.isfile(args.data):
        print(f"miles-lite eval: data file {args.data!r} does not exist", file=sys.stderr)
        return 2
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from miles_lite.cli.eval_source import SourceError, has_tokenizer, resolve_source
    from miles_lite.config import load_config
    from miles_lite.config.compose import ConfigFileError
    from miles_lite.data.gsm8k import DatasetError

    with tempfile.TemporaryDirectory(prefix="miles-lite-eval-") as tmp:
        try:
            source = resolve_source(args.model, Path(tmp))
            cfg = load_config(list(args.overrides), recorded=source.recorded)
        except SourceError as err:
            print(f"miles-lite eval: {err}", file=sys.stderr)
            return 2
        except (ConfigFileError, HydraException, OmegaConfBaseException) as err:
            print(f"miles-lite eval: configuration error: {err}", file=sys.stderr)
            return 2
        if args.data is None and source.recorded is None:
            print(f"miles-lite eval: {args.model} is a model directory: give DATA (a file, 'synthetic' or 'sets'); "
                  "only a run or a checkpoint knows what it was evaluated on", file=sys.stderr)
            return 2
        cfg.rollout.engines = args.engines
        cfg.model.hf_path = str(source.model_dir)
        if has_tokenizer(source.model_dir) or source.recorded is None:
            cfg.model.tokenizer_path = str(source.model_dir)
        if args.max_new_tokens is not None:
            cfg.rollout.max_new_tokens = args.max_new_tokens
        if source.recorded is not None:
            print(f"miles-lite eval: {source.what}, with the run's configuration", flush=True)
        try:
            if args.data == SETS or cfg.data.source == "records":
                return _eval_sets(args, cfg, None if args.data in (None, SETS) else args.data)
            return _eval_math(args, cfg)
        except (DatasetError, ValueError) as err:
            hint = ""
            if cfg.data.source != "records" and "each record needs 'question' and 'answer'" in str(err):
                hint = ("; a records file needs data.source=records and its key mapping (data.prompt_key=..., "
                        "data.label_key=...), or evaluate the run that trained on it, which knows both")
            print(f"miles-lite eval: {err}{hint}", file=sys.stderr)
            return 2


def _eval_math(args: argparse.Namespace, cfg) -> int:
    """The worklog's table on math problems: DATA, or without it the run's held-out problems (and its sets)."""
    from transformers import AutoTokenizer

    from miles_lite.config.views import EngineFleetConfig
    from miles_lite.data.encoding import PromptEncoder
    from miles_lite.data.problems import load_problems, read_problems
    from miles_lite.engines.fleet_launch import build_rollout
    from miles_lite.evaluation.greedy import evaluate
    from miles_lite.rollout.prompt_spec import sampling_from_config

    if args.data is None:
        problems = load_problems(cfg.data, cfg.experiment.eval_size)[1][: args.n]
        where = "its held-out problems"
        if not problems:
            raise ValueError("the run evaluated no held-out problems (experiment.eval_size=0); give DATA")
    else:
        problems = read_problems(args.data, args.n if args.n or args.data != "synthetic" else 64, cfg.data.synthetic)
        where = args.data
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer_path or cfg.model.hf_path)
    encoder = PromptEncoder(tokenizer, cfg.data.prompt_template, raw_prompts=not cfg.data.chat_template)
    rollout = build_rollout(EngineFleetConfig.of(cfg), tokenizer, args.log_dir)
    try:
        result = evaluate(rollout.manager, problems, encoder.render, encoder.encode,
                          sampling_from_config(cfg.rollout, stop_token_ids=encoder.stop_token_ids))
    finally:
        rollout.close()
    print(result.table(f"{args.model} on {where}"))
    if args.data is None and cfg.data.eval_sets:
        return _eval_sets(args, cfg, None)
    return 0


def _eval_sets(args: argparse.Namespace, cfg, data_file: str | None) -> int:
    """The evaluation sets of the configuration (or `data_file` as one set), as a run evaluates them."""
    from pathlib import Path

    from transformers import AutoTokenizer

    from miles_lite.config.schema import EvalSetConfig
    from miles_lite.config.validate import eval_set_problems
    from miles_lite.config.views import EngineFleetConfig
    from miles_lite.data.encoding import PromptEncoder
    from miles_lite.data.problems import EvalSet, load_data_file, load_eval_sets
    from miles_lite.engines.fleet_launch import build_rollout
    from miles_lite.evaluation.sets import evaluate_set
    from miles_lite.rollout.prompt_spec import sampling_from_config
    from miles_lite.run.task_check import check_task, run_reward_set

    if problems := eval_set_problems(cfg):
        raise ValueError("; ".join(problems))
    if data_file is not None:
        items = load_data_file(cfg.data, data_file)
        sets = [EvalSet(Path(data_file).stem, EvalSetConfig(path=data_file), items[: args.n] if args.n else items)]
    else:
        sets = load_eval_sets(cfg.data, cfg.experiment.eval_size)
    if not sets:
        raise ValueError("DATA 'sets' but no evaluation set is configured: set data.eval_sets (or data.eval_path "
                         "with data.source=records), or pass a data file")
    check_task(cfg, [], sets)
    reward_set = run_reward_set(cfg)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer_path or cfg.model.hf_path)
    encoder = PromptEncoder(tokenizer, cfg.data.prompt_template, max_prompt_tokens=cfg.data.max_prompt_tokens,
                            raw_prompts=not cfg.data.chat_template)
    sampling = sampling_from_config(cfg.rollout, stop_token_ids=encoder.stop_token_ids, seed=cfg.experiment.seed)
    rollout = build_rollout(EngineFleetConfig.of(cfg), tokenizer, args.log_dir)
    try:
        results = [evaluate_set(rollout.manager, s, encoder, sampling, reward_set) for s in sets]
    finally:
        rollout.close()
    for result in results:
        print(result.table(str(args.model)))
    return 0
