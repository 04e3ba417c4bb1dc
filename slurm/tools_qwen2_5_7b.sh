#!/usr/bin/env bash
# Qwen2.5-7B-Instruct with a sandboxed Python tool (multi-turn rollouts, DAPO), 1 node x 8 GPUs (80 GB): one srun
# task per GPU running `megatron-rlvr train`.
#
#   mkdir -p logs && sbatch slurm/tools_qwen2_5_7b.sh       # from the repo root (Slurm does not create logs/)
#   RLVR_DRY_RUN=1 bash slurm/tools_qwen2_5_7b.sh           # (with SLURM_* set) print the srun line, run nothing
#
# Environment overrides (see slurm/common.sh for details): RLVR_HOME RLVR_CONFIG RLVR_OVERRIDES RLVR_CMD
# RLVR_RUN_DIR RLVR_VENV RLVR_SETUP RLVR_MAX_REQUEUES RLVR_SRUN_WAIT_S RLVR_SRUN_EXTRA CONTAINER_IMAGE
# CONTAINER_MOUNTS CONTAINER_WORKDIR RLVR_DRY_RUN. #SBATCH values are overridden by sbatch flags or SBATCH_*
# variables. Logs: logs/<job name>-<job id>.out. Run dir: runs/<job name>-<job id>/. Preemption: SIGUSR1 180 s
# before the time limit -> checkpoint, exit 75 -> requeue -> resume (contract in slurm/common.sh).
#
# The tool runs in sandbox processes on the rollout ranks' nodes (docs/agentic.md, "The sandbox"): a network
# namespace needs root or unprivileged user namespaces there, otherwise the sandbox says which guard it lacks.
#
# Layout (configs/tools_qwen2_5_7b.yaml): training TP=4, PP=1 (DP=2), rollout TP=1 (8 vLLM engines), full recompute.
# `megatron-rlvr plan configs/tools_qwen2_5_7b.yaml --search` on 1 x 8 x 80 GiB, micro-batch 16384 tokens, max
# sequence 2048 + 8192 (GiB per GPU; usable 73.6):
#    tp  cp  pp  rtp   dp   train  rollout    peak  kv seqs  verdict
#     4   1   1    1    2    28.6     63.3    63.3     43.5  fits   <- chosen
#     1   1   1    1    8    73.3     95.2    95.2     43.5  no: rollout phase needs 95.2 GiB
#     2   1   1    1    4    43.5     73.9    73.9     43.5  no: rollout phase needs 73.9 GiB
# Why: at TP=2 the training state kept on the GPU during rollouts (31.9 GiB) and the engine's 40 GiB leave no
# room; TP=4 holds both, and 8 independent rollout TP=1 engines each cache ~44 sequences of 10240 tokens.
#SBATCH --job-name=tools-7b
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=48:00:00
#SBATCH --output=logs/%x-%j.out
#SBATCH --open-mode=append
#SBATCH --signal=USR1@180
#SBATCH --requeue

RLVR_HOME=${RLVR_HOME:-${SLURM_SUBMIT_DIR:-$(pwd)}}
RLVR_CONFIG=${RLVR_CONFIG:-configs/tools_qwen2_5_7b.yaml}
# shellcheck source=slurm/common.sh
source "$RLVR_HOME/slurm/common.sh"
rlvr_main
