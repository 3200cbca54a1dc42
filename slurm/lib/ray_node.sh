#!/usr/bin/env bash
# One Ray node of a role, run by srun as one task per node: `ray_node.sh ROLE [--head]`.
#
# ROLE is trainer or rollout; the node registers the custom resource `miles_ROLE` (one unit per GPU
# Slurm bound to the task, or per CPU on a GPU-less node) so each role's actors land on the nodes of
# its gang. `--head` starts the head (GCS) on this node. Ray blocks in the foreground (`--block`),
# and SIGTERM to this task (srun forwards it; scancel sends it) stops every Ray process it started.
#
# Environment (exported by slurm/train.sh): MILES_RAY_HEAD_IP, MILES_RAY_PORT, MILES_RAY_TMP,
# MILES_RAY_READY_TIMEOUT, MILES_SLURM_LIB; optional MILES_RAY_NUM_CPUS, MILES_RAY_OBJECT_STORE_BYTES,
# MILES_SLURM_WATCH_S, MILES_RAY_HEAD_LOST_S (the watchdog below).
#
# The node never outlives the job. The job's end reaches a step through its node's slurmd; a node whose slurmd
# is lost (killed, hung, partitioned) never hears of it. So a watchdog asks slurmctld every MILES_SLURM_WATCH_S
# seconds (default 10) whether the job still runs, and on a worker node also checks that the Ray head still
# accepts connections: when the job has ended, or the head has been gone for MILES_RAY_HEAD_LOST_S seconds
# (default 30), it stops this node's Ray and the step ends. A Ray that exits after start-up is never restarted
# against a head that is gone.
set -euo pipefail
source "$MILES_SLURM_LIB/common.sh"

role=${1:?usage: ray_node.sh trainer|rollout [--head]}
case "$role" in trainer | rollout) ;; *) die "ray_node.sh: role must be trainer or rollout, got '$role'" ;; esac
is_head=0
[ "${2:-}" != --head ] || is_head=1

gpus=$(visible_gpu_count)
cpus=${MILES_RAY_NUM_CPUS:-${SLURM_CPUS_PER_TASK:-${SLURM_CPUS_ON_NODE:-$(nproc)}}}
units=$gpus
[ "$units" -gt 0 ] || units=$cpus

# Explicit agent ports: with port 0 the raylet waits a fixed 15 s for each agent to report the port
# it bound (a loaded node overruns that), and the default dashboard-agent port collides when two
# raylets share a host. A per-node temp dir keeps socket names of raylets on one host apart.
mapfile -t ports < <(python "$MILES_SLURM_LIB/free_ports.py" 4)
tmp=$MILES_RAY_TMP/$role-${SLURM_HET_GROUP:-s}-${SLURM_PROCID:-0}
mkdir -p "$tmp"

args=(--block --disable-usage-stats --temp-dir="$tmp"
      --num-cpus="$cpus" --num-gpus="$gpus" --resources="{\"miles_$role\": $units}"
      --dashboard-agent-grpc-port="${ports[0]}" --dashboard-agent-listen-port="${ports[1]}"
      --runtime-env-agent-port="${ports[2]}" --metrics-export-port="${ports[3]}")
[ -z "${MILES_RAY_OBJECT_STORE_BYTES:-}" ] || args+=(--object-store-memory="$MILES_RAY_OBJECT_STORE_BYTES")

node=${SLURMD_NODENAME:-$(hostname -s)}
# Ray's workers inherit this: an engine's actor reports the role of the node it landed on.
export MILES_RAY_ROLE=$role
if [ "$is_head" -eq 1 ]; then
  what="Ray head ($role, gpus=$gpus cpus=$cpus) on $MILES_RAY_HEAD_IP:$MILES_RAY_PORT"
  cmd=(ray start --head --node-ip-address="$MILES_RAY_HEAD_IP" --port="$MILES_RAY_PORT" --include-dashboard=false
       "${args[@]}")
else
  # A worker started before the GCS listens retries in native code and ignores SIGTERM: wait first.
  wait_tcp "$MILES_RAY_HEAD_IP" "$MILES_RAY_PORT" "${MILES_RAY_READY_TIMEOUT:-300}" \
    || die "$node: Ray head $MILES_RAY_HEAD_IP:$MILES_RAY_PORT not reachable; read logs/ray-head.log"
  what="Ray worker ($role, gpus=$gpus cpus=$cpus) joining $MILES_RAY_HEAD_IP:$MILES_RAY_PORT"
  cmd=(ray start --address="$MILES_RAY_HEAD_IP:$MILES_RAY_PORT" "${args[@]}")
fi

# `ray start` gives its raylet a fixed 30 s to register with the GCS and exits 1 when an overloaded
# node misses that; such a start-up failure is retried. A node that ran longer than the start-up
# window and then died is not restarted (the job's Ray would silently lose state).
# Nothing is left to drain when the job stops Ray; Ray's default waits up to 30 s per node.
export RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=${RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S:-2}
ray_pid=""
stopping=0
watchdog_pid=""
trap 'stopping=1; [ -z "$ray_pid" ] || kill -TERM "$ray_pid" 2>/dev/null' TERM INT
trap '[ -z "$watchdog_pid" ] || kill "$watchdog_pid" 2>/dev/null' EXIT

# job_running: slurmctld lists the job as running (no answer from slurmctld is not an end: it may restart).
job_running() {
  local out rc=0
  out=$(squeue -h -j "$SLURM_JOB_ID" -o %T 2>&1) || rc=$?
  if [ "$rc" -ne 0 ]; then
    case "$out" in *"Invalid job id"*) return 1 ;; *) return 0 ;; esac
  fi
  case "$out" in "" | *RUNNING* | *CONFIGURING* | *SUSPENDED* | *RESIZING* | *SIGNALING*) return 0 ;; esac
  return 1
}

# watchdog MAIN_PID: stop the node (TERM to this script) once the job ended or, on a worker, the head is gone.
watchdog() {
  local main=$1 period=${MILES_SLURM_WATCH_S:-10} lost_s=${MILES_RAY_HEAD_LOST_S:-30} gone_since=""
  while sleep "$period"; do  # the poll period: neither event reaches this node when its slurmd is lost
    if ! job_running; then
      log "$node: job $SLURM_JOB_ID is no longer running; stopping this Ray node"
      kill -TERM "$main" 2>/dev/null
      return 0
    fi
    [ "$is_head" -eq 0 ] || continue
    if tcp_open "$MILES_RAY_HEAD_IP" "$MILES_RAY_PORT"; then
      gone_since=""
    elif [ -z "$gone_since" ]; then
      gone_since=$(date +%s)
    elif [ $(( $(date +%s) - gone_since )) -ge "$lost_s" ]; then
      log "$node: the Ray head $MILES_RAY_HEAD_IP:$MILES_RAY_PORT is gone (${lost_s}s); stopping this Ray node"
      kill -TERM "$main" 2>/dev/null
      return 0
    fi
  done
}
watchdog $$ &
watchdog_pid=$!
attempts=${MILES_RAY_START_ATTEMPTS:-3}
for attempt in $(seq 1 "$attempts"); do
  log "$node: $what (attempt $attempt/$attempts)"
  started=$(date +%s)
  "${cmd[@]}" &
  ray_pid=$!
  while :; do
    rc=0
    wait "$ray_pid" || rc=$?
    pid_alive "$ray_pid" || break  # the TERM trap interrupted the wait; Ray is stopping
  done
  ray_pid=""
  [ "$stopping" -eq 0 ] || exit 0
  if [ $(( $(date +%s) - started )) -gt "${MILES_RAY_READY_TIMEOUT:-300}" ]; then
    die "$node: Ray exited with code $rc after running $(( $(date +%s) - started )) s"
  fi
  if [ "$is_head" -eq 0 ] && ! tcp_open "$MILES_RAY_HEAD_IP" "$MILES_RAY_PORT"; then
    die "$node: Ray exited with code $rc and its head $MILES_RAY_HEAD_IP:$MILES_RAY_PORT is gone; not restarting it"
  fi
  log "$node: ray start failed with code $rc during start-up"
done
die "$node: Ray did not start in $attempts attempts; see the raylet logs under $tmp/session_latest/logs"
