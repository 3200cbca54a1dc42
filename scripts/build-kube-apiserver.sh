#!/usr/bin/env bash
# Build a real kube-apiserver (Kubernetes 1.20.2, from Debian's fully vendored source package) once,
# cache it outside the repository, and reuse it on later calls. Also installs etcd-server.
#
#   scripts/build-kube-apiserver.sh            # prints the binary path; builds only when it is missing
#
# Cache layout under ${MILES_LITE_CACHE:-/var/cache/miles-lite}/kube-apiserver:
#   bin/kube-apiserver   the binary (stripped), used by tests/integration/services/kube_apiserver.py
#   src/ gocache/ apt/   build inputs, kept so a rebuild is incremental
# Needs root for apt-get (golang-go, etcd-server, reflect2) when those are not installed yet.
# Cost on 2 cores: about 5-9 minutes of CPU the first time, well under a second afterwards.
set -euo pipefail

CACHE="${MILES_LITE_CACHE:-/var/cache/miles-lite}/kube-apiserver"
BIN="$CACHE/bin/kube-apiserver"
K8S_VERSION="1.20.2"
NICE="${MILES_LITE_BUILD_NICE:-10}"

mkdir -p "$CACHE/bin"
exec 9>"$CACHE/build.lock"
# A second concurrent caller waits for the first build instead of starting another one.
flock 9

install_missing() {
  (($#)) || return 0
  echo "installing $*" >&2
  apt-get -o DPkg::Lock::Timeout=900 update -qq >&2
  DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=900 install -y -qq --no-install-recommends "$@" >&2
}

# etcd is needed at test time, the Go toolchain only for a build.
command -v etcd >/dev/null || install_missing etcd-server
if [[ -x "$BIN" ]] && "$BIN" --version >/dev/null 2>&1; then
  echo "$BIN"
  exit 0
fi
need_pkgs=()
command -v go >/dev/null || need_pkgs+=(golang-go)
[[ -d /usr/share/gocode/src/github.com/modern-go/reflect2 ]] || need_pkgs+=(golang-github-modern-go-reflect2-dev)
install_missing "${need_pkgs[@]}"

# deb-src through a private sources dir, so /etc/apt stays untouched.
APT="$CACHE/apt"
mkdir -p "$APT/parts" "$APT/lists/partial"
# The source archive is the machine's own configured Debian mirror.
uri=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
[[ -n "$uri" ]] || uri=$(awk '$1 == "deb" {print $2; exit}' /etc/apt/sources.list 2>/dev/null || true)
if [[ -z "$uri" ]]; then
  echo "build-kube-apiserver: no Debian mirror found in /etc/apt sources; configure apt first" >&2
  exit 1
fi
cat >"$APT/parts/src.sources" <<SRC
Types: deb-src
URIs: $uri
Suites: bookworm
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
A=(-o Dir::Etc::SourceList=/dev/null -o "Dir::Etc::SourceParts=$APT/parts" -o "Dir::State::Lists=$APT/lists")

SRC_DIR="$CACHE/src"
K="$SRC_DIR/kubernetes-$K8S_VERSION"
mkdir -p "$SRC_DIR"
if [[ ! -d "$K/cmd/kube-apiserver" ]]; then
  apt-get "${A[@]}" update -qq >&2
  (cd "$SRC_DIR" && apt-get "${A[@]}" source --download-only kubernetes >&2)
  tar -C "$SRC_DIR" -xzf "$(ls "$SRC_DIR"/kubernetes_*.orig.tar.gz | head -n1)"
  # Go 1.19 with the vendored reflect2 1.0.1 crashes in json-iterator map encoding; Debian's 1.0.2 works.
  rm -rf "$K/vendor/github.com/modern-go/reflect2"
  cp -a /usr/share/gocode/src/github.com/modern-go/reflect2 "$K/vendor/github.com/modern-go/reflect2"
fi

# GOPATH mode, as upstream's hack/lib/golang.sh builds it (module mode wants go.mod updates).
G="$SRC_DIR/gopath"
mkdir -p "$G/src/k8s.io"
ln -sfn "$K" "$G/src/k8s.io/kubernetes"
export GO111MODULE=off GOPATH="$G" GOPROXY=off CGO_ENABLED=0 GOCACHE="$CACHE/gocache" GOFLAGS=
cd "$G/src/k8s.io/kubernetes"

OPENAPI=pkg/generated/openapi/zz_generated.openapi.go
if [[ ! -s "$OPENAPI" ]]; then
  # The release tarball lacks the generated OpenAPI definitions; generate them with the vendored tool.
  nice -n "$NICE" go build -o "$CACHE/bin/openapi-gen" k8s.io/kubernetes/vendor/k8s.io/kube-openapi/cmd/openapi-gen
  dirs=$(grep -Rl --include='*.go' '+k8s:openapi-gen=' pkg cmd plugin vendor/k8s.io \
    | grep -vE '^vendor/k8s.io/(code-generator|sample-apiserver)/' \
    | xargs -n1 dirname | LC_ALL=C sort -u | sed 's#^#k8s.io/kubernetes/#' | paste -sd,)
  nice -n "$NICE" "$CACHE/bin/openapi-gen" --logtostderr -i "$dirs" -p k8s.io/kubernetes/pkg/generated/openapi \
    -O zz_generated.openapi -h vendor/k8s.io/code-generator/hack/boilerplate.go.txt \
    -r "$CACHE/openapi_violations.report" -o "$G/src" 2>"$CACHE/openapi-gen.log"
fi

echo "building kube-apiserver $K8S_VERSION (several minutes on 2 cores)" >&2
nice -n "$NICE" go build -p "${MILES_LITE_BUILD_JOBS:-2}" \
  -ldflags "-s -w -X k8s.io/kubernetes/vendor/k8s.io/component-base/version.gitVersion=v$K8S_VERSION" \
  -o "$BIN.tmp" k8s.io/kubernetes/cmd/kube-apiserver
mv -f "$BIN.tmp" "$BIN"
"$BIN" --version >&2
echo "$BIN"
