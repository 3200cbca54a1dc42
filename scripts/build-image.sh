#!/usr/bin/env bash
# Build the miles-lite container images with podman or docker.
#
#   scripts/build-image.sh [cpu|gpu] [--tag REF] [--base IMAGE | --debootstrap] [--push]
#                          [--ca-bundle FILE] [--build-arg NAME=VALUE ...]
#
#   cpu   miles-lite, CPU torch, reference engine; runs the operator and CPU jobs (images/cpu.Containerfile)
#   gpu   SGLang + megatron-core + TransformerEngine on one torch, on a CUDA devel base or Debian 12
#         (images/gpu.Containerfile)
#
# The image name is kept in one place, k8s/kustomization.yaml (`images:` name and newTag): the CPU
# image is tagged NAME:TAG and the GPU image NAME:TAG-gpu, the names the operator gives jobs that do
# not set spec.image. --tag REF tags another name (your registry), --push pushes it.
# --debootstrap makes the Debian 12 base locally with mmdebstrap (no registry needed; cached under
# ${MILES_LITE_CACHE:-/var/cache/miles-lite}/images); the GPU variant's base also holds the compiler
# and headers its build needs (CUDA comes from NVIDIA's Python wheels, see images/gpu.Containerfile).
# --ca-bundle FILE: CA certificates pip trusts while the GPU image installs packages (behind a proxy
# that re-signs TLS); mounted for the build only (podman), never stored in the image.
# CONTAINER_ENGINE=podman|docker picks the tool.
# On hosts without systemd, podman runs with images/podman-nosystemd.conf unless CONTAINERS_CONF is set.
# Prints the built image reference as its last line.
set -euo pipefail
shopt -s inherit_errexit # a failure inside $(...) (the base's import) stops the script too
cd "$(dirname "$0")/.."
REPO=$PWD

variant=cpu
tag=""
base=""
debootstrap=0
push=0
ca_bundle=""
build_args=()
build_opts=()
while (($#)); do
  case "$1" in
    cpu | gpu) variant=$1 ;;
    --tag) tag=$2; shift ;;
    --base) base=$2; shift ;;
    --debootstrap) debootstrap=1 ;;
    --push) push=1 ;;
    --ca-bundle) ca_bundle=$2; shift ;;
    --build-arg) build_args+=(--build-arg "$2"); shift ;;
    -h | --help) sed -n '2,21p' "$0"; exit 0 ;;
    *) echo "build-image.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done

engine=${CONTAINER_ENGINE:-}
if [[ -z "$engine" ]]; then
  if command -v podman >/dev/null; then engine=podman
  elif command -v docker >/dev/null; then engine=docker
  else echo "build-image.sh: neither podman nor docker is installed" >&2; exit 1
  fi
fi
if [[ "$engine" == podman && -z "${CONTAINERS_CONF:-}" && "$(cat /proc/1/comm 2>/dev/null)" != systemd ]]; then
  export CONTAINERS_CONF="$REPO/images/podman-nosystemd.conf"
fi

if [[ -n "$ca_bundle" ]]; then
  [[ "$variant" == gpu ]] || { echo "build-image.sh: --ca-bundle is for the GPU image (the CPU build uses no package index)" >&2; exit 2; }
  [[ -f "$ca_bundle" ]] || { echo "build-image.sh: --ca-bundle $ca_bundle is not a file" >&2; exit 2; }
  [[ "$engine" == podman ]] || { echo "build-image.sh: --ca-bundle needs podman (a build-time mount)" >&2; exit 2; }
  build_opts+=(-v "$(realpath "$ca_bundle"):/run/build-ca.crt:ro")
  build_args+=(--build-arg PIP_CERT=/run/build-ca.crt)
fi

# The default name: k8s/kustomization.yaml's images entry (newName if set, else name; newTag).
default_ref() {
  awk '
    /^images:/ {in_images = 1; next}
    in_images && /^[^ -]/ {in_images = 0}
    in_images && $1 == "-" && $2 == "name:" {name = $3}
    in_images && $1 == "name:" {name = $2}
    in_images && $1 == "newName:" {newname = $2}
    in_images && $1 == "newTag:" {newtag = $2}
    END {if (newname != "") name = newname; if (name == "" || newtag == "") exit 1; print name ":" newtag}
  ' k8s/kustomization.yaml
}
if [[ -z "$tag" ]]; then
  tag=$(default_ref) || { echo "build-image.sh: no images: name/newTag in k8s/kustomization.yaml" >&2; exit 1; }
  [[ "$variant" == gpu ]] && tag="$tag-gpu"
fi

CACHE="${MILES_LITE_CACHE:-/var/cache/miles-lite}/images"
mkdir -p "$CACHE"
# One build at a time (they share .image-build/ and the caches): a second waits, then finds them filled.
exec 9>"$CACHE/.build.lock"
flock 9

# A Debian 12 base made with mmdebstrap, imported once per package list ($1).
debootstrap_base() {
  local packages=$1
  local key
  key=$(printf 'bookworm minbase %s' "$packages" | sha256sum | cut -c1-12)
  local ref="localhost/miles-lite-base:bookworm-$key"
  if "$engine" image inspect "$ref" >/dev/null 2>&1; then echo "$ref"; return; fi
  local tar="$CACHE/base-bookworm-$key.tar"
  if [[ ! -f "$tar" || ! -s "$tar" ]]; then
    command -v mmdebstrap >/dev/null || { echo "build-image.sh: --debootstrap needs mmdebstrap (apt-get install mmdebstrap)" >&2; exit 1; }
    echo "build-image.sh: building the Debian 12 base with mmdebstrap" >&2
    # mmdebstrap picks its output format from the name: it must end in .tar to be a tarball.
    rm -rf "$tar" "$CACHE/base-bookworm-$key.partial.tar"
    mmdebstrap --variant=minbase --include="$packages" bookworm "$CACHE/base-bookworm-$key.partial.tar" >&2
    mv -f "$CACHE/base-bookworm-$key.partial.tar" "$tar"
  fi
  "$engine" import --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["/bin/bash"]' "$tar" "$ref" >&2
  echo "$ref"
}

# The CPU image's Python packages, resolved on this host with the project's constraints. Keyed by
# the dependency inputs, so an unchanged pyproject.toml reuses both the wheelhouse and the image layer.
wheelhouse() {
  local py=${PYTHON:-python3}
  [[ -x .venv/bin/python ]] && py=.venv/bin/python
  local key
  key=$(cat pyproject.toml constraints/cpu.txt | sha256sum | cut -c1-16)
  local dir="$CACHE/wheels-$key"
  if [[ ! -f "$dir/.complete" ]]; then
    rm -rf "$dir"
    echo "build-image.sh: resolving the wheelhouse ($dir)" >&2
    "$py" -m pip wheel -q --wheel-dir "$dir" -c constraints/cpu.txt '.[k8s]' 'setuptools>=69' wheel >&2
    rm -f "$dir"/miles_lite-*.whl
    touch "$dir/.complete"
  fi
  rm -rf .image-build/wheels
  mkdir -p .image-build
  cp -al "$dir" .image-build/wheels 2>/dev/null || cp -a "$dir" .image-build/wheels
  rm -f .image-build/wheels/.complete
}

if [[ "$debootstrap" == 1 ]]; then
  [[ -n "$base" ]] && { echo "build-image.sh: --base and --debootstrap exclude each other" >&2; exit 2; }
  if [[ "$variant" == gpu ]]; then
    # What the GPU Containerfile would otherwise install with apt (it skips that when all are here).
    base=$(debootstrap_base "python3,python3-venv,python3-dev,build-essential,git,ca-certificates,libnuma1,bash")
  else
    base=$(debootstrap_base "python3,python3-venv,ca-certificates,bash")
  fi
fi
[[ -n "$base" ]] && build_args+=(--build-arg "BASE_IMAGE=$base")

if [[ "$variant" == cpu ]]; then
  wheelhouse
fi
echo "build-image.sh: $engine build $variant -> $tag" >&2
"$engine" build -f "images/$variant.Containerfile" -t "$tag" "${build_opts[@]}" "${build_args[@]}" . >&2
rm -rf .image-build
if [[ "$push" == 1 ]]; then
  "$engine" push "$tag" >&2
fi
echo "$tag"
