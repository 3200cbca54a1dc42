"""The CLI skips interpreter-shutdown collections only when it is the process's entry point."""

from __future__ import annotations

import gc
import subprocess
import sys

from miles_lite.cli import main


def test_main_with_argv_leaves_the_collector_alone(tmp_path):
    frozen = gc.get_freeze_count()
    assert main(["report", str(tmp_path / "not-a-run")]) == 2
    assert gc.get_freeze_count() == frozen


def test_console_entry_freezes_the_heap_before_exit(tmp_path):
    code = ("import gc, sys; from miles_lite.cli import main; "
            f"sys.argv = ['miles-lite', 'report', {str(tmp_path / 'not-a-run')!r}]; "
            "rc = main(); print(rc, gc.get_freeze_count() > 1000)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.splitlines()[-1].split() == ["2", "True"], out.stdout + out.stderr
