#!/usr/bin/env bash
# Qwen2.5-14B, MCPO, 4 nodes x 8 GPUs (80 GB): one srun task per GPU running `megatron-rlvr train`.
#
#   mkdir -p logs && sbatch slurm/mcpo_14b.sh              # from the repo root (Slurm does not create logs/)
#   RLVR_OVERRIDES="train.lr=5e-7" sbatch slurm/mcpo_14b.sh
#   sbatch --nodes=8 --partition=gpu --account=myproj --time=24:00:00 slurm/mcpo_14b.sh   # sbatch flags win
#   RLVR_DRY_RUN=1 bash slurm/mcpo_14b.sh                  # (with SLURM_* set) print the srun line, run nothing
#
# Environment overrides (see slurm/common.sh for details): RLVR_HOME RLVR_CONFIG RLVR_OVERRIDES RLVR_CMD
# RLVR_RUN_DIR RLVR_VENV RLVR_SETUP RLVR_MAX_REQUEUES RLVR_SRUN_WAIT_S RLVR_SRUN_EXTRA CONTAINER_IMAGE
# CONTAINER_MOUNTS CONTAINER_WORKDIR RLVR_DRY_RUN. #SBATCH values are overridden by sbatch flags or SBATCH_*
# variables (SBATCH_PARTITION, SBATCH_ACCOUNT, SBATCH_TIMELIMIT, ...).
# Logs: logs/<job name>-<job id>.out (appended across requeues). Run dir: runs/<job name>-<job id>/.
# Preemption: 180 s before the time limit every task gets SIGUSR1, the trainer checkpoints and exits 75, and
# the job requeues itself and resumes (contract in slurm/common.sh).
#
# Layout (configs/mcpo_14b.yaml): training TP=4, PP=1 (DP=8), rollout TP=2 (16 vLLM engines), full recompute.
# `megatron-rlvr plan configs/mcpo_14b.yaml --search` on 4 x 8 x 80 GiB, micro-batch 24576 tokens, max sequence
# 2048 + 20480, vLLM gpu_memory_utilization 0.5 (GiB per GPU; usable 73.6 = 80 x 0.92):
#    tp  cp  pp  rtp   dp   train  rollout    peak  kv seqs  verdict
#     1   1   1    2   32   121.6    129.7   129.7     11.8  no: training phase needs 121.6 GiB
#     2   1   1    2   16    64.9     88.4    88.4     11.8  no: rollout phase needs 88.4 GiB (training state 46.4 + vLLM 40)
#     4   1   1    1    8    36.5     67.8    67.8      2.5  fits
#     4   1   1    2    8    36.5     67.8    67.8     11.8  fits   <- chosen
#     4   1   1    4    8    36.5     67.8    67.8     30.2  fits
#     2   1   2    2    8    41.4     67.8    67.8     11.8  fits
#     8   1   1    2    4    22.4     57.5    57.5     11.8  fits
# Why: TP=4 is the smallest TP that keeps the training state (weights 6.9 + fp32 grads 13.8 + optimizer shard
# 5.2 GiB) resident while vLLM holds its 40 GiB; TP=2 needs 88 GiB in the rollout phase. TP=4 stays inside one
# node's NVLink domain and keeps DP=8, which also shards the optimizer 8 ways; PP=2 x TP=2 fits too but adds a
# pipeline bubble for no memory gain, TP=8 halves DP for memory we do not need. Rollout TP=2: a TP=1 engine
# (27.5 GiB of weights) leaves KV cache for only 2.5 sequences of 22.5k tokens, TP=2 gives 11.8 per engine
# (265k tokens; many more at typical lengths) with 16 independent engines; TP=4 would double the all-reduces per
# decoded token for a cache we do not need. Without recompute training needs 73.6 GiB: full recompute (3.7 GiB).
#SBATCH --job-name=mcpo-14b
#SBATCH --nodes=4
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=48:00:00
#SBATCH --output=logs/%x-%j.out
#SBATCH --open-mode=append
#SBATCH --signal=USR1@180
#SBATCH --requeue

RLVR_HOME=${RLVR_HOME:-${SLURM_SUBMIT_DIR:-$(pwd)}}
RLVR_CONFIG=${RLVR_CONFIG:-configs/mcpo_14b.yaml}
# shellcheck source=slurm/common.sh
source "$RLVR_HOME/slurm/common.sh"
rlvr_main
