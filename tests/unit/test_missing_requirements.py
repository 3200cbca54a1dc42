"""images/missing_requirements.py: what the GPU image installs after miles-lite's `--no-deps` install."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "images" / "missing_requirements.py"


@pytest.fixture(scope="module")
def mr():
    spec = importlib.util.spec_from_file_location("missing_requirements", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _names(reqs) -> set[str]:
    return {r.name for r in reqs}


def test_declared_takes_the_plain_requirements_and_those_of_the_extras_named(mr):
    plain, k8s = _names(mr.declared("miles-lite")), _names(mr.declared("miles-lite[k8s]"))
    assert {"torch", "hydra-core", "ray"} <= plain
    assert "kopf" not in plain and "kopf" in k8s and plain <= k8s
    assert "pytest" not in k8s and "sglang" not in k8s
    # Markers are evaluated for this interpreter: one of the two megatron-core lines applies.
    assert len([r for r in mr.declared("miles-lite") if r.name == "megatron-core"]) == 1


def test_unsatisfied_names_absent_and_out_of_range_distributions_only(mr):
    from packaging.requirements import Requirement

    reqs = [Requirement(t) for t in ("torch>=999", "no-such-distribution-xyz", "torch>=1",
                                     "torch<1; python_version < '3'")]
    assert [str(r) for r in mr.unsatisfied(reqs)] == ["torch>=999", "no-such-distribution-xyz"]
    # Absent only: an installed distribution at another version is left as it is.
    assert [str(r) for r in mr.unsatisfied(reqs, absent_only=True)] == ["no-such-distribution-xyz"]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60)


def test_cli_prints_what_pip_should_install_and_check_fails_on_it():
    # This environment has miles-lite with its k8s extra installed: nothing is missing.
    ok = _run("--of", "miles-lite[k8s]")
    assert ok.returncode == 0 and ok.stdout == ""
    listed = _run("--of", "miles-lite[k8s]", "torch>=999", "no-such-distribution-xyz")
    assert listed.returncode == 0 and listed.stdout.split() == ["torch>=999", "no-such-distribution-xyz"]
    checked = _run("--check", "--of", "miles-lite[k8s]", "torch>=999")
    assert checked.returncode == 1 and checked.stdout == ""
    assert "torch>=999 (installed: " in checked.stderr
    assert _run("--check", "--of", "miles-lite[k8s]", "torch>=1").returncode == 0
    absent = _run("--absent", "--of", "miles-lite[k8s]", "torch>=999", "no-such-distribution-xyz")
    assert absent.returncode == 0 and absent.stdout.split() == ["no-such-distribution-xyz"]
