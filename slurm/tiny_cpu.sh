#!/usr/bin/env bash
# The `tiny` preset on one CPU node: 2 srun tasks (TP=2), torch.distributed over gloo, no GPU.
# Runs on the single-node CI cluster (tools/slurm_local.sh) and on any CPU partition.
#
#   mkdir -p logs && sbatch slurm/tiny_cpu.sh              # from the repo root (Slurm does not create logs/)
#   RLVR_CMD="python tests/slurm_standin.py allreduce" sbatch slurm/tiny_cpu.sh   # any SPMD program instead
#
# Environment overrides (see slurm/common.sh for details): RLVR_HOME RLVR_CONFIG RLVR_OVERRIDES RLVR_CMD
# RLVR_RUN_DIR RLVR_VENV RLVR_SETUP RLVR_MAX_REQUEUES RLVR_SRUN_WAIT_S RLVR_SRUN_EXTRA CONTAINER_IMAGE
# CONTAINER_MOUNTS CONTAINER_WORKDIR RLVR_DRY_RUN; RLVR_DIST_BACKEND (default gloo). #SBATCH values are
# overridden by sbatch flags or SBATCH_* variables. Logs: logs/<job name>-<job id>.out.
# Preemption: SIGUSR1 180 s before the time limit -> checkpoint, exit 75 -> requeue -> resume.
#SBATCH --job-name=tiny-cpu
#SBATCH --nodes=1
#SBATCH --ntasks=2
#SBATCH --cpus-per-task=1
#SBATCH --time=00:30:00
#SBATCH --output=logs/%x-%j.out
#SBATCH --open-mode=append
#SBATCH --signal=USR1@180
#SBATCH --requeue

RLVR_HOME=${RLVR_HOME:-${SLURM_SUBMIT_DIR:-$(pwd)}}
RLVR_CONFIG=${RLVR_CONFIG:-configs/tiny.yaml}
export RLVR_DIST_BACKEND=${RLVR_DIST_BACKEND:-gloo}
# Two ranks on a 2-core node: one intra-op thread each, or they fight over the cores.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# shellcheck source=slurm/common.sh
source "$RLVR_HOME/slurm/common.sh"
rlvr_main
