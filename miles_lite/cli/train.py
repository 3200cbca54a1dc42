"""Run RL training. Positional arguments are Hydra overrides of the configuration in `conf/`:

    miles-lite train                                   the embedded default (experiment=tiny_cpu)
    miles-lite train trainer.tp=2 rollout.engines=4    change fields
    miles-lite train experiment=gsm8k_qwen2.5_0.5b model.hf_path=/ckpt/Qwen2.5-0.5B-Instruct
    miles-lite train --cfg job                         print the resolved configuration and exit
"""

from __future__ import annotations

import argparse
import sys
from typing import Any


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `miles-lite train`."""
    parser.add_argument("overrides", nargs="*", metavar="OVERRIDE",
                        help="Hydra override, e.g. trainer.tp=2, rollout=sglang, experiment=tiny_cpu")
    parser.add_argument("--cfg", choices=("job", "all"), default=None,
                        help="print the resolved configuration (job: as the run uses it) and exit")
    parser.add_argument("--config-dir", default=None,
                        help="a directory of your own configuration files, searched before the project's conf/ "
                             "(e.g. DIR/experiment/mine.yaml for experiment=mine)")
    parser.add_argument("--config-name", default="config", help="top-level config file name without .yaml")


def compose_or_explain(args: argparse.Namespace, check: bool = True):
    """Compose and (with `check`) validate the configuration; print a readable error and return None on bad
    input. Without `check` only keys and types are checked, which needs no heavy import (torch)."""
    from miles_lite.cli.overrides import compose_reporting_all

    cfg, problems = compose_reporting_all(list(args.overrides), args.config_dir, args.config_name)
    if cfg is None:
        for line in problems:
            print(f"miles-lite train: configuration error: {line}", file=sys.stderr)
        return None
    return cfg if not check or validated(cfg) else None


def validated(cfg: Any) -> bool:
    """Validate the composed configuration; print every problem and return False on bad input."""
    from miles_lite.config import ConfigError, validate

    try:
        validate(cfg)
    except ConfigError as err:
        print(f"miles-lite train: {err}", file=sys.stderr)
        return False
    return True


def this_command(args: argparse.Namespace) -> str:
    """The command line that started this run, as a shell reads it (the same command continues the run)."""
    import os
    import shlex

    prog = ["miles-lite"] if os.path.basename(sys.argv[0]) == "miles-lite" else [sys.executable, "-m", "miles_lite.cli"]
    options = ["--config-dir", args.config_dir] if args.config_dir else []
    if args.config_name != "config":
        options += ["--config-name", args.config_name]
    return shlex.join([*prog, "train", *options, *args.overrides])


def resume_hint(args: argparse.Namespace, run_dir: str, checkpoint: bool, timestamped: bool) -> str:
    """How to go on with a run that stopped early: the exact command, where to run it, what it does."""
    import os

    what = "continues it from its newest checkpoint" if checkpoint else "starts it again (warm-up included)"
    lines = [f"miles-lite train: to go on, run in {os.getcwd()} the same command again; it {what}:",
             f"  {this_command(args)}"]
    if timestamped:
        name = os.path.basename(os.path.normpath(run_dir))
        lines.append(f"  (with other settings, name the run: experiment.run_name={name}; a new run instead: "
                     "checkpoint.resume=none)")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Compose, validate, then print (`--cfg`) or train.

    Exit codes: 0 done (or stopped by a signal, with a checkpoint), 2 bad input (configuration, data
    files, an unwritable or full output directory, a run directory held by another run, a resume asking
    for changes its checkpoint cannot take), 3 training halted by a guard (diverged or non-finite steps),
    4 a plug-in failed (reward, group filter, generate function, environment, remote reward model; the
    newest committed checkpoint is the resume point), 5 the run's Ray cluster lost a node (named in the last
    line, with the step and the checkpoint a rerun resumes from), 130 aborted by a second Ctrl-C (the newest
    committed checkpoint is the resume point). A run that stopped early prints the command that continues it.
    """
    cfg = compose_or_explain(args, check=False)
    if cfg is None:
        return 2
    prestarted = None if args.cfg else start_engines_ahead(cfg)
    try:
        return _run(args, cfg, prestarted)
    finally:
        if prestarted is not None:
            prestarted.close()  # those the run did not take (it ended early, or needed fewer)


def start_engines_ahead(cfg: Any) -> Any:
    """The run's local reference engine processes, started once the keys and types of its configuration check
    out: they load their libraries while this process validates the configuration, reads the data and starts
    the trainer (`rollout.prestarted`). None for other runs."""
    if cfg.cluster.mode != "local":
        return None
    from miles_lite.engines.reference.prestart import prestart_engines

    return prestart_engines(cfg.rollout)


def _run(args: argparse.Namespace, cfg: Any, prestarted: Any) -> int:
    if not validated(cfg):
        return 2
    if args.cfg:
        from miles_lite.config import to_yaml

        print(to_yaml(cfg), end="")
        return 0
    from miles_lite.run.stop import EXIT_ABORTED, RunAborted, StopRequest

    # Installed before the heavy imports below: a pre-emption signal during start-up still stops cleanly.
    stop = StopRequest().install()
    try:
        return _train(args, cfg, stop, prestarted)
    except RunAborted as aborted:
        print(f"miles-lite train: {aborted}; nothing of the interrupted step was saved", file=sys.stderr)
        print(resume_hint(args, str(aborted.run_dir), aborted.checkpoint is not None,
                          not cfg.experiment.run_name), file=sys.stderr)
        return EXIT_ABORTED
    except KeyboardInterrupt:  # before the run had a directory (start-up, data checks)
        print("miles-lite train: aborted by a second Ctrl-C before the run started", file=sys.stderr)
        return EXIT_ABORTED
    finally:
        stop.restore()


def _train(args: argparse.Namespace, cfg, stop, prestarted: Any = None) -> int:
    from miles_lite.data.gsm8k import DatasetError
    from miles_lite.run.dir_probe import OutputDirError
    from miles_lite.run.driver import train
    from miles_lite.run.failure import EXIT_PLUGIN_FAILED, RunEndedByPlugin
    from miles_lite.run.lock import RunDirInUseError
    from miles_lite.run.node_loss import EXIT_NODE_LOST, RunEndedByNodeLoss
    from miles_lite.run.record import ResumeRefused

    try:
        summary = train(cfg, stop, prestarted)
    except (RunDirInUseError, OutputDirError, ResumeRefused) as err:
        print(f"miles-lite train: {err}", file=sys.stderr)
        return 2
    except RunEndedByPlugin as err:
        print(f"miles-lite train: {err}", file=sys.stderr)
        print(resume_hint(args, err.run_dir, err.checkpoint, not cfg.experiment.run_name), file=sys.stderr)
        return EXIT_PLUGIN_FAILED
    except RunEndedByNodeLoss as err:
        print(f"miles-lite train: {err}", file=sys.stderr)
        return EXIT_NODE_LOST
    except DatasetError as err:  # raised before the run has a directory
        detail = "; ".join(line.strip() for line in str(err).splitlines() if line.strip())
        print(f"miles-lite train: data error: {detail} (check data.train_path / data.eval_path)", file=sys.stderr)
        return 2
    if summary.stopped_by_signal:
        print(resume_hint(args, summary.run_dir, summary.steps_done > 0, not cfg.experiment.run_name), file=sys.stderr)
    if summary.stopped_reason is not None and not summary.stopped_by_signal:
        return 3  # a guard halted training; the final checkpoint holds the last good weights
    return 0
