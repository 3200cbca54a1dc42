# Shared helpers of slurm/train.sh (sourced, not executed).

log() { printf '%s miles-slurm: %s\n' "$(date '+%F %T')" "$*"; }
die() { log "error: $*" >&2; exit 1; }

# has_override KEY ARG...: true when an ARG sets KEY as a Hydra override (KEY=, +KEY= or ++KEY=).
has_override() {
  local key=$1 arg
  shift
  for arg in "$@"; do
    case "$arg" in "$key="* | "+$key="* | "++$key="*) return 0 ;; esac
  done
  return 1
}

# override_value KEY ARG...: prints the value the last override of KEY sets (nothing when none does).
override_value() {
  local key=$1 arg value=""
  shift
  for arg in "$@"; do
    case "$arg" in "$key="* | "+$key="* | "++$key="*) value=${arg#*"$key="} ;; esac
  done
  printf '%s' "$value"
}

# visible_gpu_count: how many GPUs Slurm bound to this task (entries of CUDA_VISIBLE_DEVICES).
visible_gpu_count() {
  local cvd=${CUDA_VISIBLE_DEVICES:-}
  case "$cvd" in "" | NoDevFiles) echo 0; return ;; esac
  awk -F, '{print NF}' <<<"$cvd"
}

# last_line FILE: the last non-blank line of FILE, trimmed to 400 characters (empty when there is none).
last_line() {
  [ -r "$1" ] || return 0
  tail -n 200 "$1" | awk 'NF {line = $0} END {print substr(line, 1, 400)}'
}

# pid_alive PID: the process runs and is not a zombie.
pid_alive() {
  [ -r "/proc/$1/stat" ] && [ "$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null)" != Z ]
}

# tcp_open HOST PORT: something accepts connections there.
tcp_open() { (exec 3<>"/dev/tcp/$1/$2") 2>/dev/null; }

# wait_tcp HOST PORT TIMEOUT_S [PID]: poll until HOST:PORT accepts, PID (if given) dies, or the time is up.
wait_tcp() {
  local host=$1 port=$2 deadline=$(( $(date +%s) + $3 )) pid=${4:-}
  until tcp_open "$host" "$port"; do
    [ -z "$pid" ] || pid_alive "$pid" || return 2
    [ "$(date +%s)" -lt "$deadline" ] || return 1
    sleep 0.5
  done
}

# stop_pids GRACE_S PID...: SIGTERM, poll up to GRACE_S seconds, then SIGKILL whatever still runs.
stop_pids() {
  local grace=$1 pid deadline left
  shift
  for pid in "$@"; do kill -TERM "$pid" 2>/dev/null || true; done
  deadline=$(( $(date +%s) + grace ))
  while :; do
    left=()
    for pid in "$@"; do pid_alive "$pid" && left+=("$pid"); done
    [ "${#left[@]}" -eq 0 ] && return 0
    [ "$(date +%s)" -lt "$deadline" ] || break
    sleep 0.2
  done
  log "still running after ${grace}s, sending SIGKILL: ${left[*]}"
  for pid in "${left[@]}"; do kill -KILL "$pid" 2>/dev/null || true; done
}

# primary_ip: this host's address for Ray (MILES_RAY_HEAD_IP overrides; multi-NIC nodes may need it).
primary_ip() {
  local ip=${MILES_RAY_HEAD_IP:-}
  [ -n "$ip" ] || ip=$(hostname -I 2>/dev/null | awk '{print $1}')
  [ -n "$ip" ] || ip=$(getent hosts "$(hostname)" | awk '{print $1; exit}')
  [ -n "$ip" ] || die "cannot determine this node's IP address: set MILES_RAY_HEAD_IP"
  printf '%s' "$ip"
}
