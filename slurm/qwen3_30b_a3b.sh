#!/usr/bin/env bash
# Qwen3-30B-A3B (mixture of experts: 128 experts, top-8), DAPO, 4 nodes x 8 GPUs (80 GB), 4k responses: one srun
# task per GPU running `megatron-rlvr train`.
#
#   mkdir -p logs && sbatch slurm/qwen3_30b_a3b.sh         # from the repo root (Slurm does not create logs/)
#   RLVR_OVERRIDES="train.routing_replay=r2" sbatch slurm/qwen3_30b_a3b.sh
#   RLVR_DRY_RUN=1 bash slurm/qwen3_30b_a3b.sh             # (with SLURM_* set) print the srun line, run nothing
#
# Environment overrides (see slurm/common.sh for details): RLVR_HOME RLVR_CONFIG RLVR_OVERRIDES RLVR_CMD
# RLVR_RUN_DIR RLVR_VENV RLVR_SETUP RLVR_MAX_REQUEUES RLVR_SRUN_WAIT_S RLVR_SRUN_EXTRA CONTAINER_IMAGE
# CONTAINER_MOUNTS CONTAINER_WORKDIR RLVR_DRY_RUN. #SBATCH values are overridden by sbatch flags or SBATCH_*
# variables. Logs: logs/<job name>-<job id>.out. Run dir: runs/<job name>-<job id>/. Preemption: SIGUSR1 180 s
# before the time limit -> checkpoint, exit 75 -> requeue -> resume (contract in slurm/common.sh).
#
# Layout (configs/qwen3_30b_a3b.yaml): training TP=2 (sequence parallel), PP=1, DP=16; experts EP=8, expert TP=1,
# expert-DP=4; rollout TP=4 (8 vLLM engines); full recompute.
# `megatron-rlvr plan configs/qwen3_30b_a3b.yaml --search` on 4 x 8 x 80 GiB, micro-batch 16384 tokens, max
# sequence 1024 + 4096, vLLM gpu_memory_utilization 0.4 (GiB per GPU; usable 73.6 = 80 x 0.92):
#    tp  pp  rtp   dp  ep   train  rollout    peak  kv seqs  verdict
#     1   1    4   32   8    59.2     73.5    73.5    134.5  fits (0.1 GiB to spare)
#     1   1    4   32  16    49.1     63.4    63.4    134.5  fits
#     2   1    1   16   8    46.6     69.3    69.3      0.0  no: vLLM weights 56.9 GiB > its 32 GiB at rollout TP=1
#     2   1    2   16   8    46.6     69.3    69.3      6.6  fits
#     2   1    4   16   4    66.9     89.5    89.5    134.5  no: rollout phase needs 89.5 GiB
#     2   1    4   16   8    46.6     69.3    69.3    134.5  fits   <- chosen
#     2   1    4   16  16    36.5     59.1    59.1    134.5  fits
#     2   1    8   16   8    46.6     69.3    69.3    195.0  fits
#     2   2    4    8   8    33.6     57.0    57.0    134.5  fits
#     4   1    4    8   8    40.3     67.1    67.1    134.5  fits
# Why: the routed experts are 95% of the parameters (29.0 of 30.5 B), so the expert layout decides the memory.
# EP=8 puts each MoE layer's 128 experts on the 8 GPUs of one node (16 whole experts per GPU, expert TP 1: no
# TP traffic inside an expert), so the token all-to-all of every MoE layer (48 layers, dispatch and combine,
# forward and backward) stays on NVLink; EP=16 or 32 fits with less memory but sends that all-to-all over the
# inter-node network, and EP=4 does not fit (89.5 GiB in the rollout phase: 32 experts per GPU and their grads).
# Expert-DP = 32 / 8 = 4 shards the experts' Adam state. Attention is small (h=2048, 4 KV heads): TP=2 halves the
# dense part and turns on sequence parallelism, which MoE layers need under TP; TP=1 fits with 0.1 GiB to spare,
# too little for fragmentation, and TP=4 or PP=2 cost communication or a pipeline bubble for memory we do not need.
# Rollout TP=4: vLLM holds every expert (57 GiB of bf16 weights), which does not fit at TP=1 in the engine's
# 32 GiB; TP=2 leaves KV cache for only 6.6 sequences of 5120 tokens per engine, TP=4 for 134 (each of the 8
# engines samples 64 x 16 / 8 = 128 responses a step, all in flight at once); TP=8 would double the all-reduces per
# decoded token for a cache we do not need. Without recompute the activations alone are 50.6 GiB: full recompute
# (2.6 GiB).
#SBATCH --job-name=qwen3-30b-a3b
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
RLVR_CONFIG=${RLVR_CONFIG:-configs/qwen3_30b_a3b.yaml}
# shellcheck source=slurm/common.sh
source "$RLVR_HOME/slurm/common.sh"
rlvr_main
