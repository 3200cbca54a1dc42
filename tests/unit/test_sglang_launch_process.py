"""What the SGLang launcher (`engines.sglang.launch`) sets in its own process before SGLang starts, which SGLang's
processes inherit: the open-files soft limit raised to what SGLang asks for (or the hard limit), SGLang's crash
diagnostics off unless the user set them (every engine stop paid their 5 s pause), and the trainer's packages kept
out of its processes (SGLang imported megatron.core and TransformerEngine in each where they were installed)."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from miles_lite.engines.sglang.launch import OPEN_FILES_WANTED, quiet_engine_stops


def _hard_limit() -> int:
    return resource.getrlimit(resource.RLIMIT_NOFILE)[1]


def _in_subprocess(code: str, env: dict[str, str] | None = None) -> dict:
    """Run `code` in a fresh interpreter (limits it changes stay there); its last stdout line, as JSON."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=60,
                          env=env, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _raised(hard: str, wanted: str = "") -> dict:
    """`raise_open_files_limit(wanted)` in a process whose soft limit is 256 and hard limit `hard`."""
    return _in_subprocess(f"""
        import json, resource
        from miles_lite.engines.sglang.launch import raise_open_files_limit
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, {hard}))
        returned = raise_open_files_limit({wanted})
        print(json.dumps({{"returned": returned, "limits": resource.getrlimit(resource.RLIMIT_NOFILE)}}))
    """)


def test_open_files_soft_limit_goes_up_to_a_hard_limit_below_sglangs_wish() -> None:
    # As on the H100 machine: the hard limit is below 65535, so SGLang's own try keeps the soft limit.
    if _hard_limit() != resource.RLIM_INFINITY and _hard_limit() < 4096:
        pytest.skip(f"hard open-files limit {_hard_limit()} here")
    out = _raised("4096")
    assert out["limits"] == [4096, 4096] and out["returned"] == [4096, 4096]


def test_open_files_soft_limit_goes_up_to_what_sglang_asks_and_never_down() -> None:
    hard = _hard_limit()
    expected = OPEN_FILES_WANTED if hard == resource.RLIM_INFINITY else min(hard, OPEN_FILES_WANTED)
    out = _raised("hard")
    assert out["limits"] == [expected, hard] and out["returned"] == [expected, hard]
    out = _raised("hard", "128")  # already above what is asked: left as it is
    assert out["limits"] == [256, hard] and out["returned"] == [256, hard]


def test_crash_diagnostics_are_off_unless_the_user_set_them() -> None:
    environ: dict[str, str] = {}
    quiet_engine_stops(environ)
    assert environ == {"SGLANG_PYSPY_DUMP_BEFORE_CRASH": "0", "SGLANG_CUDA_COREDUMP_BEFORE_CRASH": "0"}
    environ = {"SGLANG_PYSPY_DUMP_BEFORE_CRASH": "1", "SGLANG_CUDA_COREDUMP_BEFORE_CRASH": "true"}
    quiet_engine_stops(environ)
    assert environ == {"SGLANG_PYSPY_DUMP_BEFORE_CRASH": "1", "SGLANG_CUDA_COREDUMP_BEFORE_CRASH": "true"}


# Stand-ins for the two SGLang modules the launcher imports: what SGLang would find once imported.
_FAKE_SERVER_ARGS = """
import os, resource

SEEN = {"env": {k: os.environ.get(k) for k in ("SGLANG_PYSPY_DUMP_BEFORE_CRASH", "SGLANG_CUDA_COREDUMP_BEFORE_CRASH")},
        "soft": resource.getrlimit(resource.RLIMIT_NOFILE)[0]}


class Args:
    host = "127.0.0.1"
    api_key = None
    admin_api_key = None


def prepare_server_args(argv):
    return Args()
"""
_FAKE_HTTP_SERVER = """
import json
from sglang.srt.server_args import SEEN


def launch_server(server_args):
    print(json.dumps(SEEN), flush=True)
"""


def _fake_sglang(root: Path, http_server: str) -> str:
    """The two SGLang modules the launcher imports, stand-ins under `root` (`http_server`: its source); the
    PYTHONPATH that finds them and this repository."""
    pkg = root / "sglang" / "srt"
    (pkg / "entrypoints").mkdir(parents=True)
    for package in (root / "sglang", pkg, pkg / "entrypoints"):
        (package / "__init__.py").write_text("")
    (pkg / "server_args.py").write_text(_FAKE_SERVER_ARGS)
    (pkg / "entrypoints" / "http_server.py").write_text(http_server)
    return os.pathsep.join([str(root), str(Path(__file__).resolve().parents[2])])


def test_the_launcher_sets_both_before_sglang_is_imported(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_")}
    env["PYTHONPATH"] = _fake_sglang(tmp_path, _FAKE_HTTP_SERVER)
    code = """
        import resource, sys
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        from miles_lite.engines.sglang.launch import main
        sys.exit(main(["--model-path", "/m"]))
    """
    hard = _hard_limit()
    seen = _in_subprocess(code, env)
    assert seen["env"] == {"SGLANG_PYSPY_DUMP_BEFORE_CRASH": "0", "SGLANG_CUDA_COREDUMP_BEFORE_CRASH": "0"}
    assert seen["soft"] == (OPEN_FILES_WANTED if hard == resource.RLIM_INFINITY else min(hard, OPEN_FILES_WANTED))
    seen = _in_subprocess(code, {**env, "SGLANG_PYSPY_DUMP_BEFORE_CRASH": "1"})
    assert seen["env"] == {"SGLANG_PYSPY_DUMP_BEFORE_CRASH": "1", "SGLANG_CUDA_COREDUMP_BEFORE_CRASH": "0"}


# SGLang's `launch_server` as far as this matters: it spawns its scheduler (multiprocessing's spawn, as SGLang does),
# which imports megatron.core where it is installed (SGLang's debug dumper's plugin).
_SPAWNING_HTTP_SERVER = """
import json
import multiprocessing as mp


def _tries_megatron(answers):
    try:
        from megatron.core import parallel_state  # noqa: F401
        answers.put("imported")
    except ImportError as exc:
        answers.put(f"ImportError: {exc}")


def launch_server(server_args):
    ctx = mp.get_context("spawn")
    answers = ctx.Queue()
    child = ctx.Process(target=_tries_megatron, args=(answers,))
    child.start()
    seen = {"scheduler": answers.get(timeout=120)}
    child.join()
    _tries_megatron(answers)
    seen["launcher"] = answers.get(timeout=10)
    print(json.dumps(seen), flush=True)
"""


def test_the_engine_processes_never_import_the_trainers_megatron(tmp_path: Path) -> None:
    pytest.importorskip("megatron.core")  # installed beside SGLang, as in one image for both roles
    env = {**os.environ, "PYTHONPATH": _fake_sglang(tmp_path, _SPAWNING_HTTP_SERVER)}
    done = subprocess.run([sys.executable, "-m", "miles_lite.engines.sglang.launch", "--model-path", "/m"],
                          capture_output=True, text=True, timeout=180, env=env, check=True)
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["launcher"].startswith("ImportError") and seen["scheduler"].startswith("ImportError"), seen
    # The driver imports the launcher's module too (to build engine commands): megatron stays importable there.
    imported = _in_subprocess("""
        import json
        import miles_lite.engines.sglang.launch
        from megatron.core import parallel_state
        print(json.dumps({"ok": True}))
    """)
    assert imported == {"ok": True}
