#!/bin/bash
# slurm/train.sh as a heterogeneous job: component 0 = trainer nodes, component 1 = rollout nodes,
# each with its own resource shape. Submit from the repository root:
#
#   sbatch slurm/train-hetjob.sh trainer.tp=8 rollout.engines=8
#   sbatch --gres=gpu:4 slurm/train-hetjob.sh ...                  # an option given once applies to both
#   sbatch -N2 --gres=gpu:8 : -N1 --gres=gpu:8 slurm/train-hetjob.sh ...   # per component (colon syntax)
#
# Heterogeneous components never share a node, and only the backfill scheduler starts them.
#SBATCH --job-name=miles-lite
#SBATCH --time=24:00:00
#SBATCH --output=slurm/logs/%x-%j.out
#SBATCH --open-mode=append
#SBATCH --signal=B:USR1@120
#SBATCH --requeue
#SBATCH --nodes=1 --gres=gpu:8 --exclusive
#SBATCH hetjob
#SBATCH --nodes=1 --gres=gpu:8 --exclusive

# sbatch runs a copy of this file from Slurm's spool directory: find train.sh through the submit
# directory. exec keeps this process, so the signals Slurm sends to the batch shell reach train.sh.
home=${MILES_LITE_HOME:-${SLURM_SUBMIT_DIR:-$PWD}}
export MILES_SLURM_LAYOUT=${MILES_SLURM_LAYOUT:-hetjob}
exec bash "$home/slurm/train.sh" "$@"
