r"""`miles-lite presample`: k samples per question, pass@k, and a filtered data set.

    miles-lite presample --model DIR --data synthetic --n 500 --k 8 --out data/filtered.jsonl
    miles-lite presample --model DIR --data train.jsonl --engines 2 --scoring strict --out kept.parquet \
        rollout.temperature=0.8 rollout.reference_args.threads=2

Rollout engines of `rollout.backend` (default: the CPU reference engine) are started on the model,
every question is sampled k times, the completions are scored strictly (exact_check: the right
answer in the exact tagged format) and leniently (the last number in the text is right), and the
pass@1..k table of both is printed. Questions right 0/k or k/k times under `--scoring` are dropped;
the others are written to `--out` (GSM8K jsonl/parquet), with per-question counts and the pass@k
curves in `<out stem>.presample.json`.

Defaults come from the job configuration (`data.presample`, `rollout`, `data.synthetic`); the flags
below override them, and trailing KEY=VALUE arguments are Hydra overrides of any field.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from miles_lite.config.compose import load_config
from miles_lite.config.schema import MilesConfig
from miles_lite.config.views import EngineFleetConfig
from miles_lite.data.encoding import PromptEncoder
from miles_lite.data.gsm8k import MathProblem
from miles_lite.data.problems import read_problems
from miles_lite.engines.fleet_launch import build_rollout
from miles_lite.rollout.presample import SCORINGS, PresampleReport, presample, write_filtered
from miles_lite.rollout.prompt_spec import sampling_from_config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the `presample` subcommand's flags to `parser`."""
    parser.add_argument("--model", help="HF model directory the engines serve (default: model.hf_path)")
    parser.add_argument("--tokenizer", help="tokenizer directory (default: model.tokenizer_path, else --model)")
    parser.add_argument("--data", default="synthetic",
                        help="GSM8K-format .jsonl/.json/.parquet file, or 'synthetic' (data.synthetic problems)")
    parser.add_argument("--n", type=int, help="use the first N questions (synthetic: generate N)")
    parser.add_argument("--k", type=int, help="samples per question (default: data.presample.k)")
    parser.add_argument("--scoring", choices=SCORINGS,
                        help="the correctness the filter uses (default: data.presample.scoring)")
    parser.add_argument("--out", required=True, help="filtered data set to write (.jsonl/.json/.parquet)")
    parser.add_argument("--engines", type=int, help="rollout engines to start (default: rollout.engines)")
    parser.add_argument("--max-new-tokens", type=int,
                        help="tokens per completion (default: data.presample.max_new_tokens, else rollout's)")
    parser.add_argument("--temperature", type=float, help="sampling temperature (default: rollout.temperature)")
    parser.add_argument("--seed", type=int, default=0, help="base sampling seed (each sample gets its own)")
    parser.add_argument("--chunk", type=int, default=64, help="questions sent per batch of groups")
    parser.add_argument("--log-dir", help="engine server logs (default: <out dir>/presample_logs)")
    parser.add_argument("--config-dir", help="a directory of your own configuration files, searched before the "
                        "package's conf/")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="Hydra overrides, e.g. rollout.top_p=0.9")


def _config(args: argparse.Namespace) -> MilesConfig:
    cfg = load_config(list(args.overrides), args.config_dir)
    pre = cfg.data.presample
    if args.k is not None:
        pre.k = args.k
    if args.scoring is not None:
        pre.scoring = args.scoring
    if args.max_new_tokens is not None:
        pre.max_new_tokens = args.max_new_tokens
    if args.temperature is not None:
        cfg.rollout.temperature = args.temperature
    if args.engines is not None:
        cfg.rollout.engines = args.engines
    if args.model is not None:
        cfg.model.hf_path = args.model
    if args.tokenizer is not None:
        cfg.model.tokenizer_path = args.tokenizer
    if not cfg.model.hf_path:
        raise ValueError("presample needs a model: pass --model DIR (an HF directory) or model.hf_path=DIR")
    if pre.k < 1 or args.chunk < 1:
        raise ValueError(f"--k and --chunk must be >= 1, got k={pre.k}, chunk={args.chunk}")
    return cfg


def _presample(cfg: MilesConfig, problems: list[MathProblem], tokenizer: Any, log_dir: str, seed: int,
               chunk: int) -> PresampleReport:
    rollout = build_rollout(EngineFleetConfig.of(cfg), tokenizer, log_dir, seed=seed)
    try:
        encoder = PromptEncoder(tokenizer, cfg.data.prompt_template, raw_prompts=not cfg.data.chat_template)

        def progress(done: int, total: int) -> None:
            print(f"presampled {done:,}/{total:,} questions", file=sys.stderr, flush=True)

        return rollout.loop.run(presample(
            rollout.manager.manager, problems, encoder.render, encoder.encode, cfg.data.presample,
            sampling_from_config(cfg.rollout, stop_token_ids=encoder.stop_token_ids, seed=seed),
            chunk_size=chunk, progress=progress,
        ))
    finally:
        rollout.close()


def run(args: argparse.Namespace) -> int:
    """Run the presampling job; returns the process exit code (2 for bad arguments)."""
    try:
        cfg = _config(args)
        problems = read_problems(args.data, args.n, cfg.data.synthetic)
    except ValueError as exc:
        print(f"miles-lite presample: error: {exc}", file=sys.stderr)
        return 2
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer_path or cfg.model.hf_path)
    out = Path(args.out)
    log_dir = args.log_dir or str(out.parent / "presample_logs")
    report = _presample(cfg, problems, tokenizer, log_dir, args.seed, args.chunk)
    print(f"pass@k over {len(problems):,} questions, {report.k} samples each:")
    print(report.table())
    print(f"{report.scoring} scoring: {report.summary_line()}")
    written = write_filtered(problems, report, out)
    print(f"wrote {written}")
    return 0
