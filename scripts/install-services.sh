#!/usr/bin/env bash
# Debian packages of the real services the integration tests run (idempotent, root).
set -euo pipefail
cd "$(dirname "$0")/.."
packages=(prometheus slurm-wlm slurmctld slurmd slurm-client munge)
missing=()
for p in "${packages[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
