"""Stock SGLang servers: `rollout.sglang_args` -> the command line of SGLang's `launch_server` (run under
`engines.sglang.launch`, which adds the API key check).

Arguments pass through instead of being re-wrapped: every key is a `launch_server` flag without its leading
dashes (`mem_fraction_static` or `mem-fraction-static`). Mapping of values, following how SGLang 0.5.10's
`srt/server_args.py` declares its flags:

- True  -> bare flag (`--skip-tokenizer-init`: 108 flags there are `action="store_true"`);
- False -> omitted, except flags declared with `argparse.BooleanOptionalAction`, which get `--no-<flag>`;
- None or an empty list -> omitted (the flag keeps SGLang's default);
- list/tuple -> the flag once, followed by every value (`nargs="+"`/`"*"`; SGLang has no `action="append"`);
- dict -> one JSON string (flags such as `--preferred-sampling-params` are declared `type=json.loads`);
- str/int/float -> `--flag value`.

The launcher owns `--model-path`, `--host`, `--port` and `--tp-size`; setting them here is an error.
Flags SGLang renamed between the versions the project runs on (0.5.10 through 0.5.23, `RENAMED_FLAGS`) may be
given in either spelling: `for_installed_sglang` passes the one the installed SGLang's parser knows.
When SGLang is importable, `check_sglang_command` parses the command with SGLang's own parser, so a typo
fails before a GPU is touched. Engines get the project's weight-loader plugin (`with_weight_loader`) and,
for SGLang installed apart, the project root at the end of PYTHONPATH (`plugin_env`) to import it from.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import miles_lite
from miles_lite.config.engine_flags import flag_name
from miles_lite.engines.sglang.launch import LAUNCH_MODULE, split_own_flags
from miles_lite.net.ports import LOCAL_HOST
from miles_lite.weight_sync.loader_protocol import LOADER_FUNCTION

# Flags declared with argparse.BooleanOptionalAction in SGLang 0.5.10's server_args.py.
BOOLEAN_OPTIONAL_FLAGS = frozenset({"experts_shared_outer_loras"})

# Flags the launcher sets itself -> the config field that controls them.
RESERVED_FLAGS: dict[str, str] = {
    "model_path": "model.hf_path (the launcher passes the model directory)",
    "model": "model.hf_path (the launcher passes the model directory)",
    "host": "the launcher's host",
    "port": "the launcher (it allocates a free port per engine)",
    "tp_size": "rollout.engine_tp",
    "tp": "rollout.engine_tp",
    "tensor_parallel_size": "rollout.engine_tp",
    "api_key": "cluster.api_key_file (the key reaches the engine in a file, never on its command line)",
    "admin_api_key": "cluster.api_key_file (the key reaches the engine in a file, never on its command line)",
}

# (older, newer) spelling of flags SGLang renamed. 0.5.23 replaced 0.5.10's piecewise (torch.compile) prefill
# CUDA graph by a prefill phase of its CUDA-graph config (`--cuda-graph-backend-prefill`, on by default on CUDA);
# `--disable-prefill-cuda-graph` turns it off as `--disable-piecewise-cuda-graph` did. The largest decode batch
# captured, `--cuda-graph-max-bs` up to 0.5.10, became `--cuda-graph-max-bs-decode` (0.5.17 keeps the old one as
# a deprecated alias).
RENAMED_FLAGS: tuple[tuple[str, str], ...] = (("disable_piecewise_cuda_graph", "disable_prefill_cuda_graph"),
                                              ("cuda_graph_max_bs", "cuda_graph_max_bs_decode"))

_KEY = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]*$")


def _scalar(key: str, value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise ValueError(f"rollout.sglang_args.{key}: list items must be strings or numbers, got {value!r}")
    return str(value)


def sglang_flag_args(sglang_args: Mapping[str, Any]) -> list[str]:
    """Translate the pass-through mapping into `launch_server` flags (see the module docstring)."""
    argv: list[str] = []
    for raw_key, value in sglang_args.items():
        key = str(raw_key)
        if not _KEY.match(key):
            raise ValueError(f"rollout.sglang_args key {key!r} must be a flag name without leading dashes, "
                             "e.g. mem_fraction_static")
        norm = flag_name(key)
        if norm in RESERVED_FLAGS:
            raise ValueError(f"rollout.sglang_args.{key} is set by the launcher; use {RESERVED_FLAGS[norm]}")
        flag = "--" + norm.replace("_", "-")
        if value is None:
            continue
        if isinstance(value, bool):
            if value:
                argv.append(flag)
            elif norm in BOOLEAN_OPTIONAL_FLAGS:
                argv.append("--no-" + norm.replace("_", "-"))
        elif isinstance(value, list | tuple):
            if value:
                argv += [flag, *(_scalar(key, v) for v in value)]
        elif isinstance(value, Mapping):
            argv += [flag, json.dumps(dict(value))]
        elif isinstance(value, str | int | float):
            argv += [flag, str(value)]
        else:
            raise ValueError(f"rollout.sglang_args.{key}: unsupported value {value!r} of type {type(value).__name__}")
    return argv


def build_sglang_command(model_path: str, port: int, tp: int, sglang_args: Mapping[str, Any],
                         host: str = LOCAL_HOST, python: str = sys.executable,
                         api_key_file: str | None = None, insecure: bool = False) -> list[str]:
    """SGLang's server for one engine of `tp` GPUs listening on `host:port`, under `engines.sglang.launch`
    (which runs `sglang.launch_server`'s server in its process): every request must present the key that
    `api_key_file` (else $MILES_API_KEY_FILE / $MILES_API_KEY) holds; the command line carries the path only.
    Without a key it serves loopback only, unless `insecure`."""
    if tp < 1:
        raise ValueError(f"rollout.engine_tp must be >= 1, got {tp}")
    if not model_path:
        raise ValueError("model path is empty; set model.hf_path or save the initial weights first")
    flags = ["--model-path", model_path, "--host", host, "--port", str(port), "--tp-size", str(tp),
             *sglang_flag_args(sglang_args)]
    own = ["--api-key-file", api_key_file] if api_key_file is not None else []
    return [python, "-m", LAUNCH_MODULE, *own, *(["--insecure"] if insecure else []), *flags]


def with_weight_loader(loaders: Any) -> list[str]:
    """The user's `custom_weight_loader` entries (module.function paths, or None) plus the project's plugin."""
    listed = [] if loaders is None else loaders
    if not isinstance(listed, list | tuple) or not all(isinstance(x, str) for x in listed):
        raise ValueError(f"custom_weight_loader must be a list of module.function paths, got {loaders!r}")
    return [*(x for x in listed if x != LOADER_FUNCTION), LOADER_FUNCTION]


def plugin_env(env: Mapping[str, str]) -> dict[str, str]:
    """`env` with the directory holding `miles_lite` appended to PYTHONPATH (after what is there)."""
    root = str(Path(miles_lite.__file__).resolve().parent.parent)
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**env, "PYTHONPATH": os.pathsep.join(parts if root in parts else [*parts, root])}


def sglang_importable() -> bool:
    """True when the `sglang` package can be imported here."""
    return importlib.util.find_spec("sglang") is not None


def sglang_available() -> bool:
    """True when SGLang servers can run here: sglang importable and a CUDA device present."""
    if not sglang_importable():
        return False
    import torch

    return torch.cuda.is_available()


def check_sglang_command(cmd: list[str]) -> None:
    """Parse `cmd`'s flags with SGLang's own argument parser; raises ValueError on a flag it rejects.

    Needs SGLang importable (it is a no-op otherwise, so CPU-only machines can still build commands).
    """
    if not sglang_importable():
        return
    from sglang.srt.server_args import ServerArgs

    modules = [i for i, part in enumerate(cmd) if part in ("sglang.launch_server", LAUNCH_MODULE)]
    if not modules:
        raise ValueError(f"not a sglang.launch_server command: {cmd[:4]}")
    start = modules[0] + 1
    cmd = cmd[:start] + split_own_flags(cmd[start:])[1]
    parser = argparse.ArgumentParser(prog="sglang.launch_server", exit_on_error=False)
    ServerArgs.add_cli_args(parser)
    try:
        _, unknown = parser.parse_known_args(cmd[start:])
    except (argparse.ArgumentError, SystemExit) as exc:
        raise ValueError(f"SGLang rejects the launch flags {cmd[start:]}: {exc}") from exc
    if unknown:
        raise ValueError(f"SGLang does not know the flags {unknown}; check rollout.sglang_args")


def _flag(norm: str) -> str:
    return "--" + norm.replace("_", "-")


def for_installed_sglang(sglang_args: Mapping[str, Any], known: frozenset[str] | None) -> dict[str, Any]:
    """`sglang_args` with each flag of `RENAMED_FLAGS` spelt as the installed SGLang knows it.

    `known`: the option strings of the installed `launch_server` parser (`sglang_option_names`); None (SGLang
    not installed where this can see) leaves the mapping as it is. Both spellings with different values are
    an error naming them.
    """
    out = dict(sglang_args)
    if known is None:
        return out
    for older, newer in RENAMED_FLAGS:
        given = [k for k in out if flag_name(k) in (older, newer)]
        if not given:
            continue
        target = newer if _flag(newer) in known else older if _flag(older) in known else None
        if target is None:
            continue  # neither spelling: the parser check names the flag
        values = {k: out.pop(k) for k in given}
        if len({json.dumps(v, sort_keys=True) for v in values.values()}) > 1:
            raise ValueError(f"rollout.sglang_args sets {' and '.join(values)} (one flag, renamed between SGLang "
                             f"versions) to different values {list(values.values())}; keep one of them")
        out[target] = next(iter(values.values()))
    return out


def sglang_option_names() -> frozenset[str] | None:
    """The option strings of the importable SGLang's `launch_server` parser; None when SGLang is not importable."""
    if not sglang_importable():
        return None
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(prog="sglang.launch_server")
    ServerArgs.add_cli_args(parser)
    return frozenset(o for action in parser._actions for o in action.option_strings)


# Looks for SGLang before importing anything heavy (this module imports torch), so an engine environment
# without SGLang answers at once.
_PROBE = ("import importlib.util, json\n"
          "if importlib.util.find_spec('sglang') is None:\n"
          "    print('null')\n"
          "else:\n"
          "    from miles_lite.engines.sglang.command import sglang_option_names as names\n"
          "    found = names()\n"
          "    print(json.dumps(None if found is None else sorted(found)))\n")


def probe_sglang_option_names(python: str, env: Mapping[str, str] | None) -> frozenset[str] | None:
    """`sglang_option_names` as the engines will see it: asked of `python` under `env` (with the project on
    PYTHONPATH, as engines get it). None when SGLang is not importable there or the probe fails (the engine's
    own start then reports why)."""
    try:
        done = subprocess.run([python, "-c", _PROBE], env=plugin_env(os.environ if env is None else env),
                              capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
        found = json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
        return None
    return frozenset(found) if isinstance(found, list) else None


def check_flags_known(cmd: list[str], known: frozenset[str]) -> None:
    """Every `--flag` of a `launch_server` command is one the engines' SGLang declares (`known`: its option
    strings, from `probe_sglang_option_names`); raises ValueError naming the others."""
    modules = [i for i, part in enumerate(cmd) if part in ("sglang.launch_server", LAUNCH_MODULE)]
    if not modules:
        raise ValueError(f"not a sglang.launch_server command: {cmd[:4]}")
    flags = split_own_flags(cmd[modules[0] + 1:])[1]  # the key launcher's own flags are not SGLang's
    unknown = [a for a in flags if a.startswith("--") and a.split("=", 1)[0] not in known]
    if unknown:
        raise ValueError(f"the engines' SGLang does not know the flags {unknown}; check rollout.sglang_args")
