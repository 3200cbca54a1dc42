"""Evaluation of a model through the rollout engines:

    miles-lite eval MODEL_DIR DATA                 DATA: a GSM8K .jsonl/.parquet file, or 'synthetic'
    miles-lite eval outputs/run/initial_model synthetic --n 64 --engines 2
    miles-lite eval MODEL_DIR sets data.source=records data.prompt_key=prompt rewards.set=exact_match \\
        '+data.eval_sets={dev: {path: dev.jsonl, k: 4, temperature: 1.0}}'

On math problems (GSM8K files or 'synthetic') it prints the worklog's baseline table, greedy: right
number anywhere, right number inside SOLUTION, exact tag format, right answer and exact format, and how
many answers had a SOLUTION block. With DATA 'sets' it evaluates the run's evaluation sets
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
    parser.add_argument("model", metavar="MODEL_OR_CKPT", help="HF model directory (config.json + safetensors)")
    parser.add_argument("data", metavar="DATA",
                        help="GSM8K-format or records .jsonl/.parquet file, 'synthetic', or 'sets' (the configured "
                             "evaluation sets: data.eval_sets, and held_out from data.eval_path for records)")
    parser.add_argument("--n", type=int, default=None, help="first N problems (default: all; synthetic: 64)")
    parser.add_argument("--engines", type=int, default=1, help="reference/SGLang engines to start (default 1)")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="tokens per answer (default: rollout's)")
    parser.add_argument("--log-dir", default="outputs/eval_logs", help="engine server logs")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="Hydra overrides, e.g. rollout=sglang")


def run(args: argparse.Namespace) -> int:
    """Start engines on the model, evaluate, print the tables; 2 on bad arguments or data."""
    import os

    if not os.path.isfile(os.path.join(args.model, "config.json")):
        print(f"miles-lite eval: {args.model!r} has no config.json; pass an HF model directory", file=sys.stderr)
        return 2
    if args.data == SETS:
        args.data = None
    if args.data not in (None, "synthetic") and not os.path.isfile(args.data):
        print(f"miles-lite eval: data file {args.data!r} does not exist", file=sys.stderr)
        return 2
    from miles_lite.config import load_config
    from miles_lite.data.gsm8k import DatasetError

    cfg = load_config(list(args.overrides))
    cfg.rollout.engines = args.engines
    cfg.model.hf_path = args.model
    if args.max_new_tokens is not None:
        cfg.rollout.max_new_tokens = args.max_new_tokens
    try:
        if args.data is None or cfg.data.source == "records":
            return _eval_sets(args, cfg)
    except (DatasetError, ValueError) as err:
        print(f"miles-lite eval: {err}", file=sys.stderr)
        return 2
    return _eval_math(args, cfg)


def _eval_math(args: argparse.Namespace, cfg) -> int:
    from transformers import AutoTokenizer

    from miles_lite.config.views import EngineFleetConfig
    from miles_lite.data.encoding import PromptEncoder
    from miles_lite.data.problems import read_problems
    from miles_lite.engines.fleet_launch import build_rollout
    from miles_lite.evaluation.greedy import evaluate
    from miles_lite.rollout.prompt_spec import sampling_from_config

    problems = read_problems(args.data, args.n if args.n or args.data != "synthetic" else 64, cfg.data.synthetic)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    encoder = PromptEncoder(tokenizer, cfg.data.prompt_template)
    rollout = build_rollout(EngineFleetConfig.of(cfg), tokenizer, args.log_dir)
    try:
        result = evaluate(rollout.manager, problems, encoder.render, encoder.encode,
                          sampling_from_config(cfg.rollout, stop_token_ids=encoder.stop_token_ids))
    finally:
        rollout.close()
    print(result.table(f"{args.model} on {args.data}"))
    return 0


def _eval_sets(args: argparse.Namespace, cfg) -> int:
    """The evaluation sets of the configuration (or DATA as one set), as a run evaluates them."""
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
    if args.data is not None:
        items = load_data_file(cfg.data, args.data)
        sets = [EvalSet(Path(args.data).stem, EvalSetConfig(path=args.data), items[: args.n] if args.n else items)]
    else:
        sets = load_eval_sets(cfg.data, cfg.experiment.eval_size)
    if not sets:
        raise ValueError("DATA 'sets' but no evaluation set is configured: set data.eval_sets (or data.eval_path "
                         "with data.source=records), or pass a data file")
    check_task(cfg, [], sets)
    reward_set = run_reward_set(cfg)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    encoder = PromptEncoder(tokenizer, cfg.data.prompt_template, max_prompt_tokens=cfg.data.max_prompt_tokens)
    sampling = sampling_from_config(cfg.rollout, stop_token_ids=encoder.stop_token_ids, seed=cfg.experiment.seed)
    rollout = build_rollout(EngineFleetConfig.of(cfg), tokenizer, args.log_dir)
    try:
        results = [evaluate_set(rollout.manager, s, encoder, sampling, reward_set) for s in sets]
    finally:
        rollout.close()
    for result in results:
        print(result.table(str(args.model)))
    return 0
