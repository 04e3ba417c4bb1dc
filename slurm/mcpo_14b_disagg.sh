#!/usr/bin/env bash
# Qwen2.5-14B, MCPO, disaggregated: 2 training nodes + 1 rollout node (8 GPUs x 80 GB each), one srun task per GPU
# running `megatron-rlvr train`; the last node's 8 ranks only generate (parallel.rollout_ranks=8), one step off-policy
# (rollout.max_staleness=1): generation of step s + 1 overlaps training on step s (docs/algorithms.md, "Off-policy
# data"; the trainer and the engines exchange batches and versioned weights, megatron_rlvr/trainer/disaggregated.py).
#
#   mkdir -p logs && sbatch slurm/mcpo_14b_disagg.sh       # from the repo root (Slurm does not create logs/)
#   RLVR_OVERRIDES="rollout.max_staleness=2" sbatch slurm/mcpo_14b_disagg.sh
#   RLVR_DRY_RUN=1 bash slurm/mcpo_14b_disagg.sh           # (with SLURM_* set) print the srun line, run nothing
#
# Environment overrides, logs, run dir and preemption: as slurm/mcpo_14b.sh (contract in slurm/common.sh). Task
# placement: srun --distribution=block puts ranks 0..15 on the first two nodes and 16..23 on the last, so the last
# node is the rollout node. Adding nodes adds training ranks; keep parallel.rollout_ranks a multiple of 8 (whole nodes:
# the rollout ranks' NCCL weight broadcast then stays one hop per node and no GPU is shared by the two roles).
#
# Layout (configs/mcpo_14b_disagg.yaml): training TP=2, PP=1 (DP=8) on 16 GPUs, full recompute; rollout TP=1 (8 vLLM
# engines) on 8 GPUs. `megatron-rlvr plan configs/mcpo_14b_disagg.yaml --search` on 3 x 8 x 80 GiB, 8 rollout ranks,
# micro-batch 24576 tokens, max sequence 2048 + 20480, vLLM gpu_memory_utilization 0.85 (GiB per GPU: a training
# rank, a rollout rank; usable 73.6 = 80 x 0.92):
#    tp  cp  pp  rtp   dp engines   train  rollout    peak  kv seqs  verdict
#     1   1   1    1   16       8   125.7     70.0   125.7      9.3  no: a training rank needs 125.7 GiB
#     1   1   2    1    8       8    78.8     70.0    78.8      9.3  no: a training rank needs 78.8 GiB on stage 1
#     2   1   1    1    8       8    69.0     70.0    70.0      9.3  fits   <- chosen
#     2   1   1    2    8       4    69.0     70.0    70.0     25.3  fits
#     4   1   1    1    4       8    40.7     70.0    70.0      9.3  fits
#     2   1   2    1    4       8    40.3     70.0    70.0      9.3  fits
#     8   1   1    1    2       8    26.5     70.0    70.0      9.3  fits
# Why: a training rank holds no engine here (no 40 GiB vLLM share, no sleep residual), so TP=2 fits where the
# colocated layout needs TP=4 (slurm/mcpo_14b.sh): weights 13.8 + fp32 grads 27.5 + optimizer shard 10.3 (DP=8) +
# activations 7.3 (full recompute) + logits 7.0 + framework 2 = 69.0 GiB. Smaller TP means less TP all-reduce per
# layer and DP=8 (which divides the 128 prompts and the 64-prompt mini-batch); TP=4 / PP=2 would fit with more
# headroom but halve DP for memory we do not need. Rollout TP=1: a dedicated GPU at 0.85 utilisation holds the
# 27.5 GiB of weights and a 38.5 GiB KV cache (210k tokens, 9.3 full-length sequences, many more at typical
# lengths) with no tensor-parallel all-reduce per decoded token, and 8 independent engines on the node; TP=2 buys
# a larger cache per engine that decoding 16 x 8 samples per engine-step does not need. One rollout node against
# two training nodes: with 20k-token responses generation dominates a step, so async throughput is bound by the
# rollout node; watch async/trainer_wait_s (training idle) against async/rollout_wait_s on curves.png and move
# nodes between the roles (nodes=4 and parallel.rollout_ranks=16 for two rollout nodes) accordingly.
#SBATCH --job-name=mcpo-14b-disagg
#SBATCH --nodes=3
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=48:00:00
#SBATCH --output=logs/%x-%j.out
#SBATCH --open-mode=append
#SBATCH --signal=USR1@180
#SBATCH --requeue

RLVR_HOME=${RLVR_HOME:-${SLURM_SUBMIT_DIR:-$(pwd)}}
RLVR_CONFIG=${RLVR_CONFIG:-configs/mcpo_14b_disagg.yaml}
# shellcheck source=slurm/common.sh
source "$RLVR_HOME/slurm/common.sh"
rlvr_main
