# The two roles of a miles-lite job as Slurm gangs, each a set of Ray nodes (sourced by train.sh).
#
# Layouts:
#   hetjob  heterogeneous job: component 0 = trainer nodes, component 1 = rollout nodes, each with
#           its own resource shape (`srun --het-group=0/1`).
#   steps   one homogeneous allocation split into parallel job steps (`srun --exact ... &`): the
#           first MILES_SLURM_TRAINER_NODES nodes are the trainer's, the rest the rollout's; on a
#           single node the GPUs and CPUs are split between the two steps.
# The Ray head is the trainer's first node (where this batch script and the driver run).
#
# plan_layout sets: LAYOUT, TRAINER_NODES[], ROLLOUT_NODES[], TRAINER_SRUN[], ROLLOUT_SRUN[]
# (srun flags selecting each role's share), TRAINER_SHARE / ROLLOUT_SHARE ("NODES,GPUS,CPUS" per node,
# empty when unknown: hetjob), and describes the plan in PLAN_SUMMARY.

# plan_layout: decide the layout from MILES_SLURM_LAYOUT (auto | hetjob | steps) and the allocation.
plan_layout() {
  local requested=${MILES_SLURM_LAYOUT:-auto}
  case "$requested" in
    auto) if [ "${SLURM_HET_SIZE:-1}" -gt 1 ]; then LAYOUT=hetjob; else LAYOUT=steps; fi ;;
    hetjob | steps) LAYOUT=$requested ;;
    *) die "MILES_SLURM_LAYOUT must be auto, hetjob or steps, got '$requested'" ;;
  esac
  if [ "$LAYOUT" = hetjob ]; then
    _plan_hetjob
  else
    _plan_steps
  fi
}

_plan_hetjob() {
  [ "${SLURM_HET_SIZE:-1}" -eq 2 ] \
    || die "MILES_SLURM_LAYOUT=hetjob needs a heterogeneous job of 2 components (trainer : rollout), got SLURM_HET_SIZE=${SLURM_HET_SIZE:-unset}; submit slurm/train-hetjob.sh or use MILES_SLURM_LAYOUT=steps"
  mapfile -t TRAINER_NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST_HET_GROUP_0")
  mapfile -t ROLLOUT_NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST_HET_GROUP_1")
  # Without --exact a step gets all CPUs and GPUs of its component on each of its nodes.
  TRAINER_SRUN=(--het-group=0)
  ROLLOUT_SRUN=(--het-group=1)
  TRAINER_SHARE=""
  ROLLOUT_SHARE=""
  PLAN_SUMMARY="hetjob: trainer nodes ${TRAINER_NODES[*]} (component 0), rollout nodes ${ROLLOUT_NODES[*]} (component 1)"
}

_plan_steps() {
  local nodes n trainer_n gpus cpus tg rg tc rc mem_t mem_r
  mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
  n=${#nodes[@]}
  gpus=$(visible_gpu_count)
  cpus=${SLURM_CPUS_ON_NODE:-1}
  if [ "$n" -eq 1 ]; then
    # Both roles on one node: disjoint GPU and CPU shares, one step each.
    TRAINER_NODES=("${nodes[0]}")
    ROLLOUT_NODES=("${nodes[0]}")
    tg=${MILES_SLURM_TRAINER_GPUS:-$(( gpus / 2 ))}
    rg=$(( gpus - tg ))
    if [ "$gpus" -gt 0 ] && { [ "$tg" -lt 1 ] || [ "$rg" -lt 1 ]; }; then
      die "one node with $gpus GPU(s) cannot be split into trainer ($tg) and rollout ($rg) shares: request --gres=gpu:2 or more, set MILES_SLURM_TRAINER_GPUS, or use 2 nodes"
    fi
    tc=$(( cpus / 2 > 0 ? cpus / 2 : 1 ))
    rc=$(( cpus - tc > 0 ? cpus - tc : 1 ))
    mem_t=$(( ${SLURM_MEM_PER_NODE:-0} / 2 ))
    mem_r=$mem_t
  else
    trainer_n=${MILES_SLURM_TRAINER_NODES:-$(( n / 2 ))}
    if [ "$trainer_n" -lt 1 ] || [ "$trainer_n" -ge "$n" ]; then
      die "MILES_SLURM_TRAINER_NODES=$trainer_n must leave at least one node to each role of the $n allocated"
    fi
    TRAINER_NODES=("${nodes[@]:0:trainer_n}")
    ROLLOUT_NODES=("${nodes[@]:trainer_n}")
    tg=$gpus rg=$gpus tc=$cpus rc=$cpus
    mem_t=${SLURM_MEM_PER_NODE:-0} mem_r=$mem_t
  fi
  TRAINER_SHARE="${#TRAINER_NODES[@]},$tg,$tc"
  ROLLOUT_SHARE="${#ROLLOUT_NODES[@]},$rg,$rc"
  # --exact: a step gets only what it asks, so the two roles' steps run side by side.
  TRAINER_SRUN=(--exact --cpus-per-task="$tc")
  ROLLOUT_SRUN=(--exact --cpus-per-task="$rc")
  if [ "$gpus" -gt 0 ]; then
    TRAINER_SRUN+=(--gres="gpu:$tg")
    ROLLOUT_SRUN+=(--gres="gpu:$rg")
  fi
  # Where memory is a consumable resource a step asking nothing takes all of it and blocks the other.
  if [ "$mem_t" -gt 0 ]; then
    TRAINER_SRUN+=(--mem="$mem_t")
    ROLLOUT_SRUN+=(--mem="$mem_r")
  fi
  PLAN_SUMMARY="steps: trainer nodes ${TRAINER_NODES[*]} (gpus/node ${tg:-0}, cpus/node $tc), rollout nodes ${ROLLOUT_NODES[*]} (gpus/node ${rg:-0}, cpus/node $rc)"
}

# launch_ray_step LOGFILE ROLE NODE_LIST SRUN_FLAG... -- RAY_NODE_ARG...: one srun step starting a
# Ray node per listed node (comma-separated), in the background, named ray-head (with --head) or
# ray-ROLE; appends its srun pid to RAY_STEP_PIDS and sets LAST_STEP_PID.
launch_ray_step() {
  local log=$1 role=$2 nodelist=$3 count step_name
  shift 3
  local flags=()
  while [ "$#" -gt 0 ] && [ "$1" != -- ]; do flags+=("$1"); shift; done
  shift
  step_name=ray-$role
  [ "${1:-}" != --head ] || step_name=ray-head
  count=$(awk -F, '{print NF}' <<<"$nodelist")
  srun "${flags[@]}" --nodelist="$nodelist" --nodes="$count" --ntasks="$count" --ntasks-per-node=1 \
    --kill-on-bad-exit=1 --job-name="$step_name" --label \
    bash "$MILES_SLURM_LIB/ray_node.sh" "$role" "$@" >>"$log" 2>&1 &
  RAY_STEP_PIDS+=($!)
  LAST_STEP_PID=$!
}

# job_component_ids: the job ids of this job's components, comma-separated (steps of a heterogeneous
# job's component k are listed under the job id SLURM_JOB_ID + k, per HetJobIdSet).
job_component_ids() {
  local set
  set=$(scontrol show job "$SLURM_JOB_ID" 2>/dev/null | sed -n 's/.*HetJobIdSet=\([^ ]*\).*/\1/p' | head -n 1)
  if [ -z "$set" ]; then
    echo "$SLURM_JOB_ID"
    return
  fi
  tr ',' '\n' <<<"$set" | while IFS=- read -r first last; do seq "$first" "${last:-$first}"; done | paste -sd,
}

# stop_ray_steps GRACE_S SRUN_PID...: SIGTERM to the tasks of this job's Ray steps (scancel signals
# them and leaves the steps to end on their own; srun itself would turn SIGTERM into SIGKILL), then
# wait for the sruns up to GRACE_S seconds before ending them forcibly.
stop_ray_steps() {
  local grace=$1 id deadline pid alive
  shift
  while read -r id; do
    scancel --signal=TERM "$id" 2>/dev/null || true
  done < <(squeue -h -s -j "$(job_component_ids)" -o '%i %j' 2>/dev/null \
             | awk '$2 ~ /^ray-(head|trainer|rollout)$/ {print $1}')
  deadline=$(( $(date +%s) + grace ))
  while [ "$(date +%s)" -lt "$deadline" ]; do
    alive=0
    for pid in "$@"; do pid_alive "$pid" && alive=1; done
    [ "$alive" -eq 1 ] || return 0
    sleep 0.2
  done
  stop_pids 15 "$@"
}

# ray_stop_all_nodes: `ray stop` on every node of the allocation (a sweep after the steps ended; only
# safe where the nodes run no other Ray of this user, hence MILES_SLURM_RAY_STOP).
ray_stop_all_nodes() {
  local group nodes
  if [ "$LAYOUT" = hetjob ]; then
    for group in 0 1; do
      nodes=$(eval echo "\${SLURM_JOB_NODELIST_HET_GROUP_$group}")
      timeout 60 srun --het-group="$group" --overlap --nodelist="$nodes" --ntasks-per-node=1 \
        --job-name=ray-stop ray stop --grace-period 10 >/dev/null 2>&1 || true
    done
  else
    timeout 60 srun --overlap --nodelist="$SLURM_JOB_NODELIST" --ntasks-per-node=1 \
      --job-name=ray-stop ray stop --grace-period 10 >/dev/null 2>&1 || true
  fi
}
