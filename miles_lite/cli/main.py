"""`miles-lite`: the command line.

    miles-lite train [--cfg job|all] [--config-dir DIR] [OVERRIDE ...]   RL training (Hydra overrides)
    miles-lite presample ...                                             pass@k and the filtered data set
    miles-lite engine ...                                                serve the CPU reference engine
    miles-lite eval MODEL_OR_CKPT [DATA]                                 evaluation of a run, checkpoint or model
    miles-lite convert --to-hf CKPT OUT | --from-hf HF_DIR OUT           checkpoint conversion
    miles-lite report RUN_DIR                                            HTML report of a run
    miles-lite check-template [--template FAMILY|hf] [--tokenizer DIR]   chat template append-only check

Each subcommand's implementation lives beside the code it drives and exposes
`add_arguments(parser)` and `run(args) -> int`; this module only wires them.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# subcommand -> (module implementing it, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "train": ("miles_lite.cli.train", "run RL training; arguments are Hydra overrides (trainer.tp=2 ...)"),
    "presample": ("miles_lite.cli.presample", "k samples per question: pass@k and a filtered data set"),
    "engine": ("miles_lite.cli.engine", "serve the CPU reference engine (SGLang's HTTP API)"),
    "eval": ("miles_lite.cli.eval", "evaluate a run, a checkpoint or a model with the run's own task configuration"),
    "convert": ("miles_lite.cli.convert", "convert checkpoints to and from HF safetensors"),
    "report": ("miles_lite.observability.report", "write a self-contained HTML report of a run directory"),
    "check-template": ("miles_lite.cli.check_template",
                       "check that a chat template is append-only on a tokenizer (agent sessions rely on it)"),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The top-level parser; with `command`, that subcommand's parser fully built.

    Only the chosen subcommand's module is imported, so `miles-lite --help` and argument errors
    answer without importing torch or Megatron.
    """
    parser = argparse.ArgumentParser(
        prog="miles-lite",
        description="RL post-training for LLMs: Megatron-core trainer + SGLang rollout engines.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        if name != command:
            sub.add_parser(name, help=help_text)
            continue
        module = importlib.import_module(module_name)
        child = sub.add_parser(name, help=help_text, description=(module.__doc__ or help_text).strip(),
                               formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(child)
        child.set_defaults(_module=module)
    return parser


# Commands that call `startup_heap.settle()` once started (the others keep the collector running throughout).
SETTLES_HEAP = ("train", "engine")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `miles-lite` console script; returns the process exit code.

    `argv` None (the console script, `python -m miles_lite.cli`): this process ends when it returns, so
    `train` and `engine` pause collections until they have started (`startup_heap`: train settles the heap once
    its roles are up, engine once it listens) and the interpreter's shutdown collections are skipped
    (`process_exit`). A caller passing `argv` keeps running and keeps its collector as it is.
    """
    args_list = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in args_list if not a.startswith("-")), None)
    if argv is None and command in SETTLES_HEAP:  # no collections while the libraries load (`startup_heap`)
        from miles_lite.net import startup_heap

        startup_heap.pause()
    parser = build_parser(command if command in SUBCOMMANDS else None)
    args = parser.parse_args(args_list)
    try:
        code = int(args._module.run(args) or 0)
    except KeyboardInterrupt:  # Ctrl-C outside a training run's own handling (start-up, eval, report, ...)
        print(f"miles-lite {args.command}: interrupted", file=sys.stderr)
        code = 130
    if argv is None:
        from miles_lite.net.process_exit import before_interpreter_exit

        before_interpreter_exit()
    return code


if __name__ == "__main__":
    sys.exit(main())
