#!/usr/bin/env bash
# Create .venv (if missing) and install miles-lite with its test and Kubernetes extras.
# CPU machines get the CPU build of torch through constraints/cpu.txt (an unpinned torch would
# resolve to a multi-GB CUDA build). Idempotent: a second run installs nothing new.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
  .venv/bin/pip install -q --upgrade pip
fi
constraints=()
if ! command -v nvidia-smi >/dev/null 2>&1; then
  constraints=(-c constraints/cpu.txt)
fi
.venv/bin/pip install -q "${constraints[@]}" -e '.[test,k8s]'
