#!/usr/bin/env bash
# Debian packages of the real services the integration tests run (idempotent, root).
set -euo pipefail
cd "$(dirname "$0")/.."
# podman (with runc, netavark + aardvark-dns for pod DNS, iptables, catatonit for pod infra
# containers) and mmdebstrap run the Kubernetes end-to-end test's pods from a locally built image.
packages=(prometheus slurm-wlm slurmctld slurmd slurm-client munge
          podman runc netavark aardvark-dns iptables catatonit mmdebstrap)
missing=()
for p in "${packages[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# Debian's kubectl (kubernetes-client), unpacked into the cache rather than installed: a machine may
# already have another kubectl at /usr/bin/kubectl, which dpkg would refuse to overwrite.
KUBECTL_DIR="${MILES_LITE_CACHE:-/var/cache/miles-lite}/kubernetes-client"
if [ ! -x "$KUBECTL_DIR/usr/bin/kubectl" ]; then
  tmp=$(mktemp -d)
  (cd "$tmp" && apt-get download kubernetes-client >/dev/null 2>&1 || { apt-get update -qq && apt-get download kubernetes-client >/dev/null; })
  mkdir -p "$KUBECTL_DIR"
  dpkg-deb -x "$tmp"/kubernetes-client_*.deb "$KUBECTL_DIR"
  rm -rf "$tmp"
fi
