"""Greedy evaluation of a model on GSM8K-format problems, through the rollout engines:

    miles-lite eval MODEL_DIR DATA                 DATA: a GSM8K .jsonl/.parquet file, or 'synthetic'
    miles-lite eval outputs/run/initial_model synthetic --n 64 --engines 2

Prints the worklog's baseline table: right number anywhere, right number inside SOLUTION, exact tag
format, right answer and exact format, and how many answers had a SOLUTION block.
"""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `miles-lite eval`."""
    parser.add_argument("model", metavar="MODEL_OR_CKPT", help="HF model directory (config.json + safetensors)")
    parser.add_argument("data", metavar="DATA", help="GSM8K-format .jsonl/.json/.parquet file, or 'synthetic'")
    parser.add_argument("--n", type=int, default=None, help="first N problems (default: all; synthetic: 64)")
    parser.add_argument("--engines", type=int, default=1, help="reference/SGLang engines to start (default 1)")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="tokens per answer (default: rollout's)")
    parser.add_argument("--log-dir", default="outputs/eval_logs", help="engine server logs")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="Hydra overrides, e.g. rollout=sglang")


def run(args: argparse.Namespace) -> int:
    """Start engines on the model, decode greedily, print the table; 2 on bad arguments."""
    import os

    if not os.path.isfile(os.path.join(args.model, "config.json")):
        print(f"miles-lite eval: {args.model!r} has no config.json; pass an HF model directory", file=sys.stderr)
        return 2
    if args.data != "synthetic" and not os.path.isfile(args.data):
        print(f"miles-lite eval: data file {args.data!r} does not exist", file=sys.stderr)
        return 2
    from transformers import AutoTokenizer

    from miles_lite.config import load_config
    from miles_lite.data.encoding import PromptEncoder
    from miles_lite.data.problems import read_problems
    from miles_lite.engines.fleet_launch import build_rollout
    from miles_lite.evaluation import evaluate
    from miles_lite.rollout.prompt_spec import sampling_from_config

    cfg = load_config(list(args.overrides))
    cfg.rollout.engines = args.engines
    cfg.model.hf_path = args.model
    if args.max_new_tokens is not None:
        cfg.rollout.max_new_tokens = args.max_new_tokens
    problems = read_problems(args.data, args.n if args.n or args.data != "synthetic" else 64, cfg)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    encoder = PromptEncoder(tokenizer, cfg.data.prompt_template)
    rollout = build_rollout(cfg, tokenizer, args.log_dir)
    try:
        result = evaluate(rollout.manager, problems, encoder.render, encoder.encode,
                          sampling_from_config(cfg.rollout, stop_token_ids=encoder.stop_token_ids))
    finally:
        rollout.close()
    print(result.table(f"{args.model} on {args.data}"))
    return 0
