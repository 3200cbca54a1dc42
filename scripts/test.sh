#!/usr/bin/env bash
# Install, lint and run the whole test suite on this machine (CPU). Services the integration tests
# need (Prometheus, Slurm, kube-apiserver + etcd, Ray) are installed from Debian when missing and
# started and stopped by the tests' fixtures. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/install-services.sh
# For the whole suite, two cold builds run in the background while the rest runs: the Kubernetes end-to-end
# test's image (Debian base, wheelhouse, dependency layer: minutes; that test runs last and waits for the build's
# lock; a failed build is reported by the test's own build call) and the real kube-apiserver of the operator
# tests (built once from Debian's source package, then cached: 5-9 minutes of CPU on a cold machine; those tests
# run after the end-to-end ones and wait for its lock, tests/integration/services/kube_apiserver.py).
image_build="" kube_build=""
if [ "$#" -eq 0 ]; then
  build_log=$(mktemp) kube_log=$(mktemp)
  nice -n 10 bash scripts/build-image.sh cpu --debootstrap >"$build_log" 2>&1 &
  image_build=$!
  export MILES_LITE_KUBE_APISERVER_BUILDING=1
  bash scripts/build-kube-apiserver.sh >"$kube_log" 2>&1 &
  kube_build=$!
else
  bash scripts/build-kube-apiserver.sh >/dev/null
fi
.venv/bin/ruff check .
set +e
.venv/bin/python -m pytest "$@"
rc=$?
if [ -n "$kube_build" ]; then
  wait "$kube_build" || echo "background kube-apiserver build failed: $(tail -n 20 "$kube_log")" >&2
  rm -f "$kube_log"
fi
if [ -n "$image_build" ]; then
  wait "$image_build" || echo "background image build failed: $(tail -n 20 "$build_log")" >&2
  rm -f "$build_log"
fi
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: failing" >&2
  exit 1
fi
exit "$rc"
