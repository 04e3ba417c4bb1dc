#!/usr/bin/env bash
# Qwen3-8B-Base, DAPO with 32k-token responses, 2 nodes x 8 GPUs (80 GB), context parallelism CP=2: one srun task
# per GPU running `megatron-rlvr train`.
#
#   mkdir -p logs && sbatch slurm/long_qwen3_8b_32k.sh       # from the repo root (Slurm does not create logs/)
#   RLVR_DRY_RUN=1 bash slurm/long_qwen3_8b_32k.sh           # (with SLURM_* set) print the srun line, run nothing
#
# Environment overrides (see slurm/common.sh for details): RLVR_HOME RLVR_CONFIG RLVR_OVERRIDES RLVR_CMD
# RLVR_RUN_DIR RLVR_VENV RLVR_SETUP RLVR_MAX_REQUEUES RLVR_SRUN_WAIT_S RLVR_SRUN_EXTRA CONTAINER_IMAGE
# CONTAINER_MOUNTS CONTAINER_WORKDIR RLVR_DRY_RUN. #SBATCH values are overridden by sbatch flags or SBATCH_*
# variables. Logs: logs/<job name>-<job id>.out. Run dir: runs/<job name>-<job id>/. Preemption: SIGUSR1 180 s
# before the time limit -> checkpoint, exit 75 -> requeue -> resume (contract in slurm/common.sh).
#
# Layout (configs/long_qwen3_8b_32k.yaml): training TP=8, CP=2, PP=1 (DP=1), rollout TP=1 (16 vLLM engines), no
# recompute, micro-batch 139264 tokens (4 packed sequences of 2048 + 32768).
# `megatron-rlvr plan configs/long_qwen3_8b_32k.yaml --search` on 2 x 8 x 80 GiB (GiB per GPU; usable 73.6):
#    tp  cp  pp  rtp   dp   train  rollout    peak  kv seqs  verdict
#     8   2   1    1    1    56.7     53.5    56.7      4.8  fits   <- chosen
#     4   4   1    1    1    62.7     59.2    62.7      4.8  fits
#     8   1   1    1    2    98.7     53.5    98.7      4.8  no: training phase needs 98.7 GiB
#     8   1   2    1    1    85.7     50.6    85.7      4.8  no: training phase needs 85.7 GiB
#     4   2   1    1    2   104.7     59.2   104.7      4.8  no: training phase needs 104.7 GiB
# Why: without context parallelism the micro-batch's activations (74 GiB at TP=8) and logits (9.9 GiB) exceed a
# GPU at every TP x PP of the 16 GPUs (PP does not help: 1F1B keeps pp micro-batches in flight on stage 0). CP=2
# halves both (37 + 4.9 GiB); at TP=8 x CP=2 each GPU sends 102 MiB of keys and values per layer per micro-batch
# around the ring (`plan` prints it); megatron orders ranks TP first, so TP=8 fills a node's NVLink and the CP
# pair spans the two nodes. TP=4 x CP=4 fits too, with a 4-GPU ring and less headroom. Rollout TP=1: 16 independent engines, each
# caching 4.8 sequences of 34816 tokens. Full recompute would fit at TP=4 without CP, for a third more compute.
#SBATCH --job-name=long-8b-32k
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
RLVR_CONFIG=${RLVR_CONFIG:-configs/long_qwen3_8b_32k.yaml}
# shellcheck source=slurm/common.sh
source "$RLVR_HOME/slurm/common.sh"
rlvr_main
