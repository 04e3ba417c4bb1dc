#!/usr/bin/env bash
# Qwen3-32B, MCPO with 64k-token responses, 8 nodes x 8 GPUs (80 GB), context parallelism CP=4: one srun task per
# GPU running `megatron-rlvr train`. YaRN rope scaling past 40960 positions: model.rope_scaling in the config.
#
#   mkdir -p logs && sbatch slurm/long_qwen3_32b_64k.sh      # from the repo root (Slurm does not create logs/)
#   RLVR_DRY_RUN=1 bash slurm/long_qwen3_32b_64k.sh          # (with SLURM_* set) print the srun line, run nothing
#
# Environment overrides (see slurm/common.sh for details): RLVR_HOME RLVR_CONFIG RLVR_OVERRIDES RLVR_CMD
# RLVR_RUN_DIR RLVR_VENV RLVR_SETUP RLVR_MAX_REQUEUES RLVR_SRUN_WAIT_S RLVR_SRUN_EXTRA CONTAINER_IMAGE
# CONTAINER_MOUNTS CONTAINER_WORKDIR RLVR_DRY_RUN. #SBATCH values are overridden by sbatch flags or SBATCH_*
# variables. Logs: logs/<job name>-<job id>.out. Run dir: runs/<job name>-<job id>/. Preemption: SIGUSR1 180 s
# before the time limit -> checkpoint, exit 75 -> requeue -> resume (contract in slurm/common.sh).
#
# Layout (configs/long_qwen3_32b_64k.yaml): training TP=8, CP=4, PP=1 (DP=2), rollout TP=4 (16 vLLM engines), no
# recompute, micro-batch 67584 tokens (one sequence of 2048 + 65536).
# `megatron-rlvr plan configs/long_qwen3_32b_64k.yaml --search` on 8 x 8 x 80 GiB (GiB per GPU; usable 73.6):
#    tp  cp  pp  rtp   dp   train  rollout    peak  kv seqs  verdict
#     8   4   1    4    2    62.2     62.6    62.6      3.6  fits   <- chosen
#     8   2   4    4    1    73.3     46.0    73.3      3.6  fits
#     8   1   1    4    8   153.2     62.6   153.2      3.6  no: training phase needs 153.2 GiB
#     8   1   8    4    1   129.3     43.8   129.3      3.6  no: training phase needs 129.3 GiB
#     8   2   2    4    2    78.4     51.2    78.4      3.6  no: training phase needs 78.4 GiB
# Why: one 67584-token sequence keeps 117 GiB of activations per GPU at TP=8 without recompute, and pipeline
# stages do not lower stage 0's share (1F1B keeps pp micro-batches in flight), so no cp=1 layout of the 64 GPUs
# fits. CP=4 holds 16896 tokens per GPU (29 GiB of activations); each GPU sends 74 MiB of keys and values per layer
# per micro-batch around a ring of 4 nodes (4.6 GiB over the 64 layers; `plan` prints it; TP=8 fills each node's
# NVLink, megatron ordering ranks TP first). TP=8 x CP=2 x PP=4 fits with
# 0.3 GiB to spare and a 4-stage pipeline bubble. Rollout TP=4: at TP=1 or 2 vLLM's 32 GiB share does not hold
# the weights with a KV cache; TP=4 caches 3.6 sequences of 67584 tokens per engine.
#SBATCH --job-name=long-32b-64k
#SBATCH --nodes=8
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=48:00:00
#SBATCH --output=logs/%x-%j.out
#SBATCH --open-mode=append
#SBATCH --signal=USR1@180
#SBATCH --requeue

RLVR_HOME=${RLVR_HOME:-${SLURM_SUBMIT_DIR:-$(pwd)}}
RLVR_CONFIG=${RLVR_CONFIG:-configs/long_qwen3_32b_64k.yaml}
# shellcheck source=slurm/common.sh
source "$RLVR_HOME/slurm/common.sh"
rlvr_main
