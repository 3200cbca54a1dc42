"""`miles-lite engine`: run one rollout engine server in the foreground.

    miles-lite engine --model-path DIR --port 30000                       # CPU reference engine
    miles-lite engine --backend sglang --model-path DIR --port 30000 --tp 1 \
        --sglang-args '{"skip_tokenizer_init": true, "mem_fraction_static": 0.6}'

The reference backend takes every flag of `python -m miles_lite.engines.reference.engine`; the sglang backend
replaces this process with SGLang's server built from `--sglang-args` (a JSON object in `rollout.sglang_args`
form), so signals reach SGLang directly. Both load the project's weight-loader plugin, and both ask every
request but `/health` for the key in `--api-key-file FILE` (mode 0600; else $MILES_API_KEY_FILE or
$MILES_API_KEY); without a key they serve a loopback address only, unless `--insecure`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from miles_lite.engines.reference.engine import add_reference_arguments, engine_key, run_from_args
from miles_lite.engines.sglang.command import (
    build_sglang_command,
    check_sglang_command,
    for_installed_sglang,
    plugin_env,
    sglang_option_names,
    with_weight_loader,
)
from miles_lite.net.api_key import ApiKeyError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the `engine` subcommand's flags to `parser`."""
    parser.add_argument("--backend", choices=("reference", "sglang"), default="reference")
    parser.add_argument("--sglang-args", default="{}", help="sglang: JSON object of launch_server flags")
    add_reference_arguments(parser, model_required=False)
    parser.add_argument("--model-dir", default="outputs/engine-model",
                        help="without --model-path: where the job's model is prepared from the overrides")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="without --model-path: Hydra overrides naming the job's model (the same ones the "
                             "trainer gets), so a tiny random model is rebuilt identically here")


def sglang_argv(args: argparse.Namespace) -> list[str]:
    """The `sglang.launch_server` command for parsed `engine` arguments; raises ValueError on bad JSON."""
    try:
        extra = json.loads(args.sglang_args)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--sglang-args is not valid JSON: {exc}") from exc
    if not isinstance(extra, dict):
        raise ValueError("--sglang-args must be a JSON object, e.g. '{\"skip_tokenizer_init\": true}'")
    extra = for_installed_sglang(extra, sglang_option_names())
    extra["custom_weight_loader"] = with_weight_loader(extra.get("custom_weight_loader"))
    cmd = build_sglang_command(args.model_path, args.port, args.tp, extra, host=args.host,
                               api_key_file=args.api_key_file, insecure=args.insecure)
    check_sglang_command(cmd)
    return cmd


def prepare_job_model(overrides: list[str], model_dir: str) -> str:
    """The model directory the job's configuration names; a tiny random model is built (seeded, so
    identical to the trainer's) under `model_dir` when `model.hf_path` is unset."""
    from pathlib import Path

    from miles_lite.config import load_config
    from miles_lite.run.model_assets import prepare_model

    cfg, _ = prepare_model(load_config(list(overrides)), Path(model_dir))
    return str(cfg.model.hf_path)


def run(args: argparse.Namespace) -> int:
    """Serve until stopped; returns the exit code (the sglang backend does not return: it execs SGLang)."""
    try:
        engine_key(args)  # refuse an open routable address before preparing a model or exec'ing SGLang
    except ApiKeyError as exc:
        print(f"miles-lite engine: {exc}", file=sys.stderr)
        return 2
    if args.model_path is None:
        args.model_path = prepare_job_model(args.overrides, args.model_dir)
    if args.backend == "reference":
        args.custom_weight_loader = with_weight_loader(args.custom_weight_loader)
        return run_from_args(args)
    try:
        cmd = sglang_argv(args)
    except ValueError as exc:
        print(f"miles-lite engine: {exc}", file=sys.stderr)
        return 2
    os.execve(cmd[0], cmd, plugin_env(os.environ))
    return 0  # not reached: execv replaces the process
