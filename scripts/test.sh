#!/usr/bin/env bash
# Install, lint and run the whole test suite on this machine (CPU). Services the integration tests
# need (Prometheus, Slurm, kube-apiserver + etcd, Ray) are installed from Debian when missing and
# started and stopped by the tests' fixtures. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/install-services.sh
# A real kube-apiserver for the operator tests: built once from Debian's source package, then cached.
bash scripts/build-kube-apiserver.sh >/dev/null
.venv/bin/ruff check .
set +e
.venv/bin/python -m pytest "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: failing" >&2
  exit 1
fi
exit "$rc"
