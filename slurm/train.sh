#!/bin/bash
# miles-lite RL training as one Slurm job: a trainer gang and a rollout gang joined into one Ray
# cluster, then `miles-lite train` on the first trainer node. Submit from the repository root:
#
#   sbatch slurm/train.sh trainer.tp=2 rollout.engines=4                # arguments = Hydra overrides
#   sbatch --nodes=2 --gres=gpu:8 slurm/train.sh experiment=gsm8k_qwen2.5_0.5b model.hf_path=...
#   sbatch slurm/train-hetjob.sh ...                                    # heterogeneous job (see docs)
#
# Resources (defaults below; sbatch command-line options win over them):
#SBATCH --job-name=miles-lite
#SBATCH --nodes=2
#SBATCH --gres=gpu:8
#SBATCH --exclusive
#SBATCH --time=24:00:00
# Slurm writes the batch log here (the directory must exist: slurm/logs/ is part of the repository);
# the run directory links it as logs/slurm.out. Append, so a requeued run keeps the earlier log.
#SBATCH --output=slurm/logs/%x-%j.out
#SBATCH --open-mode=append
# 120 s before the time limit Slurm sends SIGUSR1 to this script (B: = the batch shell only); it is
# forwarded to the driver, which finishes its step, checkpoints and exits 0; the job then requeues.
#SBATCH --signal=B:USR1@120
# Requeue keeps SLURM_JOB_ID, hence the run directory, and checkpoint.resume=auto continues there.
#SBATCH --requeue
#
# Signals to this script (`scancel --batch --signal=...`): USR1 = checkpoint, stop, requeue;
# TERM = checkpoint, stop, no requeue. The driver's contract: on SIGUSR1 or SIGTERM it finishes the
# current step, saves a checkpoint and exits 0.
#
# Environment (all optional):
#   MILES_LITE_HOME        repository root (default: the submit directory)
#   MILES_LITE_VENV        virtualenv to activate (default: $MILES_LITE_HOME/.venv when present)
#   MILES_LITE_RUN_ROOT    parent of run directories (default: $MILES_LITE_HOME/outputs/slurm)
#   MILES_LITE_TRAIN_CMD   training command (default: miles-lite train); it gets the overrides
#   MILES_SLURM_LAYOUT     auto | hetjob | steps (auto: hetjob when SLURM_HET_SIZE > 1)
#   MILES_SLURM_TRAINER_NODES / MILES_SLURM_TRAINER_GPUS   steps layout: trainer share of nodes / of
#                          one node's GPUs when both roles share a node (default: half)
#   MILES_RAY_PORT         GCS port (default: 20000 + job id mod 10000)
#   MILES_RAY_READY_TIMEOUT  seconds for each role's Ray nodes to register (default 300)
#   MILES_RAY_TMP          Ray temp root on each node (default /tmp/miles-ray-$SLURM_JOB_ID)
#   MILES_SLURM_REQUEUE_ON_SIGNAL  1 (default) requeue after a USR1 stop; 0 never
#   MILES_SLURM_REQUEUE_ON_FAILURE 1 (default) requeue when the driver dies by a signal (SIGKILL, the OOM
#                          killer) or exits 5 (its Ray cluster lost a node), up to MILES_SLURM_MAX_REQUEUES
#                          attempts (default 3); each attempt resumes from the newest checkpoint
#   MILES_SLURM_WATCH_S    period of each Ray step's watchdog (default 10 s): a step ends once slurmctld says
#                          the job ended, or its Ray head is gone for MILES_RAY_HEAD_LOST_S (default 30 s),
#                          also on a node whose slurmd is lost (docs/slurm.md)
#   MILES_SLURM_RAY_STOP   1 (default) also run `ray stop` on every node at exit; 0 when the nodes
#                          may run other Ray instances of the same user (ray stop is host-wide)
#   MILES_API_KEY_FILE     the run's API key (a 0600 file); default: a fresh key per job attempt in the
#                          job's private directory ${TMPDIR:-/tmp}/miles-key-$SLURM_JOB_ID.* (mode 0700, removed
#                          at exit). Engines and the weight-update group ask for it; Ray hands it to the
#                          engine actors, which keep it in a private file on their node.
set -uo pipefail

MILES_LITE_HOME=${MILES_LITE_HOME:-${SLURM_SUBMIT_DIR:-$PWD}}
export MILES_SLURM_LIB=$MILES_LITE_HOME/slurm/lib
if [ ! -f "$MILES_SLURM_LIB/common.sh" ]; then
  echo "miles-slurm: $MILES_SLURM_LIB/common.sh not found: submit from the repository root or set MILES_LITE_HOME" >&2
  exit 2
fi
source "$MILES_SLURM_LIB/common.sh"
source "$MILES_SLURM_LIB/roles.sh"
[ -n "${SLURM_JOB_ID:-}" ] || die "not inside a Slurm job: submit with sbatch slurm/train.sh [OVERRIDE ...]"

venv=${MILES_LITE_VENV:-$MILES_LITE_HOME/.venv}
# shellcheck disable=SC1091
[ ! -f "$venv/bin/activate" ] || source "$venv/bin/activate"
command -v ray >/dev/null || die "ray is not on PATH: install miles-lite into a virtualenv (scripts/setup.sh) or set MILES_LITE_VENV"

# ---- run directory: keyed on the job id, which a requeue keeps --------------------------------
run_root=$(override_value experiment.output_dir "$@")
run_root=${run_root:-${MILES_LITE_RUN_ROOT:-$MILES_LITE_HOME/outputs/slurm}}
run_name=$(override_value experiment.run_name "$@")
run_name=${run_name:-${SLURM_JOB_NAME:-miles-lite}-$SLURM_JOB_ID}
RUN_DIR=$run_root/$run_name
LOGS=$RUN_DIR/logs
mkdir -p "$LOGS" || die "cannot create $LOGS"
stdout_path=$(scontrol show job "$SLURM_JOB_ID" 2>/dev/null | sed -n 's/^ *StdOut=//p' | head -n 1)
[ -z "$stdout_path" ] || ln -sfn "$stdout_path" "$LOGS/slurm.out"
attempt=${SLURM_RESTART_COUNT:-0}
log "job $SLURM_JOB_ID attempt $attempt on $(hostname -s): run directory $RUN_DIR"

# ---- the run's API key: in the job's private directory, never in the (shared) run directory ----------
KEY_DIR=""
if [ -z "${MILES_API_KEY_FILE:-}${MILES_API_KEY:-}" ] && [ -z "$(override_value cluster.api_key_file "$@")" ]; then
  KEY_DIR=$(mktemp -d "${TMPDIR:-/tmp}/miles-key-$SLURM_JOB_ID.XXXXXX") || die "cannot create a private key directory"
  (umask 077 && head -c 32 /dev/urandom | base64 | tr -d '\n=' | tr '+/' '-_' >"$KEY_DIR/api-key") ||
    die "cannot write the API key"
  export MILES_API_KEY_FILE=$KEY_DIR/api-key
fi

# ---- lifecycle: STARTING -> RAY_READY -> TRAINING -> STOPPING -> STOPPED [-> REQUEUED] -----------
# A signal in any state before STOPPING asks for a stop; cleanup runs once, also on errors (EXIT).
STATE=STARTING
STOP_SIGNAL=""
DRIVER_PID=""
RUN_OK=0
RAY_STEP_PIDS=()
LAYOUT=""

on_signal() {
  [ -n "$STOP_SIGNAL" ] || STOP_SIGNAL=$1
  log "received SIG$1 in state $STATE"
  if [ -n "$DRIVER_PID" ] && pid_alive "$DRIVER_PID"; then
    # The driver's contract: finish the step, checkpoint, exit 0. USR1 and TERM mean the same to it.
    kill -USR1 "$DRIVER_PID" 2>/dev/null || true
  fi
}
trap 'on_signal USR1' USR1
trap 'on_signal TERM' TERM

cleanup() {
  local pids=()
  case "$STATE" in STOPPING | STOPPED | REQUEUED) return 0 ;; esac
  STATE=STOPPING
  trap '' USR1 TERM
  if [ -n "$DRIVER_PID" ] && pid_alive "$DRIVER_PID"; then
    log "stopping the driver"
    stop_pids 60 "$DRIVER_PID"
  fi
  for pid in "${RAY_STEP_PIDS[@]}"; do pid_alive "$pid" && pids+=("$pid"); done
  if [ "${#pids[@]}" -gt 0 ]; then
    log "stopping Ray (${#pids[@]} job steps)"
    stop_ray_steps 30 "${pids[@]}"
  fi
  if [ "${MILES_SLURM_RAY_STOP:-1}" = 1 ] && [ -n "$LAYOUT" ]; then
    ray_stop_all_nodes
  fi
  [ -z "$KEY_DIR" ] || rm -rf "$KEY_DIR"
  if [ "$RUN_OK" = 1 ]; then
    rm -rf "${MILES_RAY_TMP:?}"
  elif [ -n "${MILES_RAY_TMP:-}" ]; then
    log "Ray's own logs stay under $MILES_RAY_TMP/*/session_latest/logs on each node"
  fi
  STATE=STOPPED
}
trap cleanup EXIT

# interruptible CMD...: run CMD in the background and wait for it, so that signals are handled at once
# (bash runs traps only between foreground commands); a stop request abandons the command.
interruptible() {
  local pid rc
  "$@" &
  pid=$!
  while :; do
    wait "$pid"
    rc=$?
    if pid_alive "$pid"; then
      if [ -n "$STOP_SIGNAL" ]; then
        stop_pids 10 "$pid"
        return 130
      fi
      continue
    fi
    return "$rc"
  done
}

# ---- Ray: head on the first trainer node, then the trainer's other nodes, then the rollout nodes ---
plan_layout
log "$PLAN_SUMMARY"
export MILES_RAY_HEAD_IP
MILES_RAY_HEAD_IP=$(primary_ip)
export MILES_RAY_PORT=${MILES_RAY_PORT:-$(( 20000 + SLURM_JOB_ID % 10000 ))}
export MILES_RAY_TMP=${MILES_RAY_TMP:-/tmp/miles-ray-$SLURM_JOB_ID}
export MILES_RAY_READY_TIMEOUT=${MILES_RAY_READY_TIMEOUT:-300}
# The driver joins without a token when RAY_AUTH_MODE is unset (miles_lite/cluster/ray_trainer.py);
# the nodes must agree, or Ray >= 2.50 would enable token auth wherever ~/.ray/auth_token exists.
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}
ray_address=$MILES_RAY_HEAD_IP:$MILES_RAY_PORT
n_trainer=${#TRAINER_NODES[@]}
n_rollout=${#ROLLOUT_NODES[@]}

# Each role is started and checked before the next: raylets starting side by side on one host can
# miss Ray's fixed agent start-up window, and a failure then names the role that failed.
ray_wait() {  # ray_wait NODES TRAINER_UNITS ROLLOUT_UNITS LOG
  local expect=(--expect "miles_trainer=$2")
  [ "$3" -eq 0 ] || expect+=(--expect "miles_rollout=$3")
  interruptible python "$MILES_SLURM_LIB/wait_ray.py" --address "$ray_address" --nodes "$1" "${expect[@]}" \
    --timeout "$MILES_RAY_READY_TIMEOUT" --watch-pid "$LAST_STEP_PID:$4"
}

# start_ray: the head, the trainer's other nodes, the rollout nodes; non-zero on failure or a stop request.
start_ray() {
  local others
  log "starting the Ray head on ${TRAINER_NODES[0]} ($ray_address)"
  launch_ray_step "$LOGS/ray-head.log" trainer "${TRAINER_NODES[0]}" "${TRAINER_SRUN[@]}" -- --head
  ray_wait 1 1 0 "$LOGS/ray-head.log" || return 1
  if [ "$n_trainer" -gt 1 ]; then
    others=$(IFS=,; echo "${TRAINER_NODES[*]:1}")
    log "starting $((n_trainer - 1)) more trainer Ray node(s): $others"
    launch_ray_step "$LOGS/ray-trainer.log" trainer "$others" "${TRAINER_SRUN[@]}" --
    ray_wait "$n_trainer" "$n_trainer" 0 "$LOGS/ray-trainer.log" || return 1
  fi
  log "starting $n_rollout rollout Ray node(s): ${ROLLOUT_NODES[*]}"
  launch_ray_step "$LOGS/ray-rollout.log" rollout "$(IFS=,; echo "${ROLLOUT_NODES[*]}")" "${ROLLOUT_SRUN[@]}" --
  ray_wait "$((n_trainer + n_rollout))" "$n_trainer" "$n_rollout" "$LOGS/ray-rollout.log"
}

# The driver's overrides: the user's, then what this job dictates unless the user set it.
defaults=()
has_override cluster "$@" || defaults+=(cluster=ray)
has_override cluster.ray_address "$@" || defaults+=("cluster.ray_address=$ray_address")
has_override cluster.trainer_resource "$@" || defaults+=(cluster.trainer_resource=miles_trainer)
has_override cluster.rollout_resource "$@" || defaults+=(cluster.rollout_resource=miles_rollout)
has_override checkpoint.dir "$@" || defaults+=("checkpoint.dir=$RUN_DIR/checkpoints")
has_override checkpoint.resume "$@" || defaults+=(checkpoint.resume=auto)
has_override experiment.output_dir "$@" || defaults+=("experiment.output_dir=$run_root")
has_override experiment.run_name "$@" || defaults+=("experiment.run_name=$run_name")
# Check the configuration and that each role fits its share before starting anything: a typo or an
# impossible placement ends the job at once, with the reason in this log.
log "checking the configuration and the placement (${#defaults[@]} job overrides, $# of yours)"
preflight_args=()
[ -z "$TRAINER_SHARE" ] || preflight_args=(--trainer "$TRAINER_SHARE" --rollout "$ROLLOUT_SHARE")
if ! preflight_out=$(python "$MILES_SLURM_LIB/preflight.py" "${preflight_args[@]}" -- "${defaults[@]}" "$@" 2>&1); then
  while IFS= read -r line; do [ -z "$line" ] || log "$line"; done <<<"$preflight_out"
  die "nothing was started; fix the overrides or the allocation and submit again"
fi

if start_ray; then
  STATE=RAY_READY
elif [ -z "$STOP_SIGNAL" ]; then
  die "Ray did not come up; the job ends"
fi

# ---- the driver ---------------------------------------------------------------------------------
read -r -a train_cmd <<<"${MILES_LITE_TRAIN_CMD:-miles-lite train}"

driver_rc=0
if [ -z "$STOP_SIGNAL" ]; then
  STATE=TRAINING
  log "running: ${train_cmd[*]} ${defaults[*]} $* (output: $LOGS/trainer.log)"
  { echo "==== $(date '+%F %T') job $SLURM_JOB_ID attempt $attempt"; } >>"$LOGS/trainer.log"
  "${train_cmd[@]}" "${defaults[@]}" "$@" >>"$LOGS/trainer.log" 2>&1 &
  DRIVER_PID=$!
  while :; do
    wait "$DRIVER_PID"
    driver_rc=$?
    pid_alive "$DRIVER_PID" || break  # a trap interrupted the wait: the driver is still running
  done
  DRIVER_PID=""
  if [ "$driver_rc" -ne 0 ]; then
    # The driver's last words (an error line or a traceback's exception) belong in this log too.
    log "driver exited with code $driver_rc: $(last_line "$LOGS/trainer.log")"
  else
    log "driver exited with code $driver_rc"
  fi
  [ "$driver_rc" -ne 0 ] || RUN_OK=1
else
  log "stop requested (SIG$STOP_SIGNAL) before training started"
  RUN_OK=1
fi

cleanup
requeue_why=""
if [ "$STOP_SIGNAL" = USR1 ] && [ "$driver_rc" -eq 0 ] && [ "${MILES_SLURM_REQUEUE_ON_SIGNAL:-1}" = 1 ]; then
  requeue_why="stopped by SIGUSR1"
elif [ -z "$STOP_SIGNAL" ] && { [ "$driver_rc" -gt 128 ] || [ "$driver_rc" -eq 5 ]; } &&
     [ "${MILES_SLURM_REQUEUE_ON_FAILURE:-1}" = 1 ]; then
  # The driver died without a goodbye (killed by signal $((driver_rc - 128)): the OOM killer, SIGKILL), or its
  # Ray cluster lost a node (exit 5): the work up to the newest checkpoint is kept, so the job tries again.
  if [ "$attempt" -lt "${MILES_SLURM_MAX_REQUEUES:-3}" ]; then
    requeue_why="the driver exited with code $driver_rc"
  else
    log "not requeueing: attempt $attempt reached MILES_SLURM_MAX_REQUEUES=${MILES_SLURM_MAX_REQUEUES:-3}"
  fi
fi
if [ -n "$requeue_why" ]; then
  STATE=REQUEUED
  log "requeueing job $SLURM_JOB_ID ($requeue_why): the next attempt resumes from the newest checkpoint in" \
    "$RUN_DIR/checkpoints"
  # Slurm ends this script right away when the requeue is accepted.
  scontrol requeue "$SLURM_JOB_ID" || log "requeue refused (submit with --requeue); resubmit with experiment.run_name=$run_name to resume"
fi
log "exit code $driver_rc"
exit "$driver_rc"
