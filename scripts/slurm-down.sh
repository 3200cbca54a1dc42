#!/usr/bin/env bash
# Stop the local Slurm cluster that scripts/slurm-up.sh started under MILES_SLURM_STATE: the two
# slurmd, slurmctld and the private munged, by the pids in their pid files (nothing else).
# SIGTERM first; after MILES_SLURM_STOP_GRACE seconds (default 5) SIGKILL, because slurm daemons
# that lost munge hang in retry loops and ignore SIGTERM. Jobs still running are cancelled first.
set -euo pipefail

STATE=${MILES_SLURM_STATE:-/tmp/miles-slurm}
GRACE=${MILES_SLURM_STOP_GRACE:-5}
S=$STATE/state
MUNGE=$STATE/munge
export SLURM_CONF=$STATE/etc/slurm.conf

alive_pid() {  # alive_pid PID: runs and is not a zombie
  [ -r "/proc/$1/stat" ] && [ "$(awk '{print $3}' "/proc/$1/stat")" != Z ]
}

stop_pids() {  # stop_pids PID...: TERM, wait up to GRACE s, then KILL the survivors
  local pid deadline left
  for pid in "$@"; do kill -TERM "$pid" 2>/dev/null || true; done
  deadline=$(( $(date +%s) + GRACE ))
  while :; do
    left=()
    for pid in "$@"; do alive_pid "$pid" && left+=("$pid"); done
    [ "${#left[@]}" -eq 0 ] && return 0
    [ "$(date +%s)" -ge "$deadline" ] && break
    sleep 0.1
  done
  echo "slurm-down: SIGKILL to ${left[*]} (still running after ${GRACE}s)" >&2
  for pid in "${left[@]}"; do kill -KILL "$pid" 2>/dev/null || true; done
}

pids_of() {  # pids_of PIDFILE...: the live pids recorded in those files
  local f pid
  for f in "$@"; do
    [ -s "$f" ] || continue
    pid=$(cat "$f")
    alive_pid "$pid" && echo "$pid"
  done
  return 0
}

if [ -f "$SLURM_CONF" ] && [ -n "$(pids_of "$S/slurmctld.pid")" ]; then
  # Cancelled jobs get their steps killed by slurmd while it still runs.
  timeout 10 scancel --full --quiet --user=root 2>/dev/null || true
fi
mapfile -t slurm_pids < <(pids_of "$S/slurmd-n1.pid" "$S/slurmd-n2.pid" "$S/slurmctld.pid")
[ "${#slurm_pids[@]}" -eq 0 ] || stop_pids "${slurm_pids[@]}"
mapfile -t munge_pids < <(pids_of "$MUNGE/munged.pid")
[ "${#munge_pids[@]}" -eq 0 ] || stop_pids "${munge_pids[@]}"
rm -f "$STATE/env.sh"
