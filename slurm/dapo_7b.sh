#!/usr/bin/env bash
# Qwen2.5-7B, DAPO, 2 nodes x 8 GPUs (80 GB): one srun task per GPU running `megatron-rlvr train`.
#
#   mkdir -p logs && sbatch slurm/dapo_7b.sh               # from the repo root (Slurm does not create logs/)
#   RLVR_DRY_RUN=1 bash slurm/dapo_7b.sh                   # (with SLURM_* set) print the srun line, run nothing
#
# Environment overrides (see slurm/common.sh for details): RLVR_HOME RLVR_CONFIG RLVR_OVERRIDES RLVR_CMD
# RLVR_RUN_DIR RLVR_VENV RLVR_SETUP RLVR_MAX_REQUEUES RLVR_SRUN_WAIT_S RLVR_SRUN_EXTRA CONTAINER_IMAGE
# CONTAINER_MOUNTS CONTAINER_WORKDIR RLVR_DRY_RUN. #SBATCH values are overridden by sbatch flags or SBATCH_*
# variables. Logs: logs/<job name>-<job id>.out. Run dir: runs/<job name>-<job id>/. Preemption: SIGUSR1 180 s
# before the time limit -> checkpoint, exit 75 -> requeue -> resume (contract in slurm/common.sh).
#
# Layout (configs/dapo_7b.yaml): training TP=2, PP=1 (DP=8), rollout TP=1 (16 vLLM engines), full recompute.
# `megatron-rlvr plan configs/dapo_7b.yaml --search` on 2 x 8 x 80 GiB, micro-batch 24576 tokens, max sequence
# 2048 + 20480 (GiB per GPU; usable 73.6):
#    tp  cp  pp  rtp   dp   train  rollout    peak  kv seqs  verdict
#     1   1   1    1   16    75.3     89.9    89.9     19.8  no: training phase needs 75.3 GiB
#     2   1   1    1    8    41.8     68.6    68.6     19.8  fits   <- chosen
#     2   1   1    2    8    41.8     68.6    68.6     51.4  fits
#     4   1   1    1    4    25.1     58.0    58.0     19.8  fits
# Why: TP=2 is the smallest TP that fits (TP=1 cannot hold weights + fp32 grads next to the vLLM engine); a 7B
# engine at rollout TP=1 (14.2 GiB of weights) still caches 446k tokens (~20 max-length sequences), so 16
# independent engines beat 8 TP=2 engines.
#SBATCH --job-name=dapo-7b
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=48:00:00
#SBATCH --output=logs/%x-%j.out
#SBATCH --open-mode=append
#SBATCH --signal=USR1@180
#SBATCH --requeue

RLVR_HOME=${RLVR_HOME:-${SLURM_SUBMIT_DIR:-$(pwd)}}
RLVR_CONFIG=${RLVR_CONFIG:-configs/dapo_7b.yaml}
# shellcheck source=slurm/common.sh
source "$RLVR_HOME/slurm/common.sh"
rlvr_main
