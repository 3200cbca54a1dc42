"""The command line: `miles-lite` and its subcommands (`train`, `presample`, `engine`, `eval`, `convert`,
`report`, `check-template`), each a module exposing `add_arguments(parser)` and `run(args) -> int`; `main` only
wires them and imports just the chosen one (`eval_source` resolves what `eval` is given: a run, a checkpoint, a
model). The top layer: it may import anything below (the run layer, roles, libraries), and nothing imports it.
`python -m miles_lite.cli ...` runs `main`.
"""

from miles_lite.cli.main import main

__all__ = ["main"]
