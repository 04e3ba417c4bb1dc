#!/usr/bin/env bash
# Moonlight-16B-A3B (DeepSeek-V3 layout: multi-latent attention, 64 experts top-6 + 2 shared, sigmoid router with a
# score-correction bias), DAPO, 1 node x 8 GPUs (80 GB), 4k responses: one srun task per GPU running
# `megatron-rlvr train`. The first MoE run of this family: one node, no inter-node traffic.
#
#   huggingface-cli download moonshotai/Moonlight-16B-A3B-Instruct --local-dir /shared/models/Moonlight-16B-A3B-Instruct
#   mkdir -p logs && sbatch slurm/moonlight_16b_a3b.sh      # from the repo root (Slurm does not create logs/)
#   RLVR_OVERRIDES="train.moe_expert_bias_update_rate=1e-3" sbatch slurm/moonlight_16b_a3b.sh
#   RLVR_DRY_RUN=1 bash slurm/moonlight_16b_a3b.sh          # (with SLURM_* set) print the srun line, run nothing
#
# Environment overrides (see slurm/common.sh for details): RLVR_HOME RLVR_CONFIG RLVR_OVERRIDES RLVR_CMD
# RLVR_RUN_DIR RLVR_VENV RLVR_SETUP RLVR_MAX_REQUEUES RLVR_SRUN_WAIT_S RLVR_SRUN_EXTRA CONTAINER_IMAGE
# CONTAINER_MOUNTS CONTAINER_WORKDIR RLVR_DRY_RUN. #SBATCH values are overridden by sbatch flags or SBATCH_*
# variables. Logs: logs/<job name>-<job id>.out. Run dir: runs/<job name>-<job id>/. Preemption: SIGUSR1 180 s
# before the time limit -> checkpoint, exit 75 -> requeue -> resume (contract in slurm/common.sh).
#
# Layout (configs/moonlight_16b_a3b.yaml): training TP=2 (sequence parallel), PP=1, DP=4; experts EP=8, expert
# TP=1, expert-DP=1; rollout TP=2 (4 vLLM engines); full recompute.
# `megatron-rlvr plan configs/moonlight_16b_a3b.yaml --search` on 1 x 8 x 80 GiB, micro-batch 16384 tokens, max
# sequence 1024 + 4096, vLLM gpu_memory_utilization 0.4 (GiB per GPU; usable 73.6 = 80 x 0.92):
#    tp  pp  rtp   dp  ep   train  rollout    peak  kv seqs  verdict
#     1   1    2    8   8    60.6     75.1    75.1    101.8  no: rollout phase needs 75.1 GiB (training state 41.1 + vLLM 32.0 + overhead), over 73.6 GiB usable (80 x 0.92)
#     2   1    1    4   8    48.1     70.9    70.9      1.8  fits   (the search's first row; see rollout TP below)
#     2   1    2    4   8    48.1     70.9    70.9    101.8  fits   <- chosen
#     2   1    2    4   4    58.2     80.9    80.9    101.8  no: rollout phase needs 80.9 GiB (training state 46.9 + vLLM 32.0 + overhead), over 73.6 GiB usable (80 x 0.92)
#     2   1    4    4   8    48.1     70.9    70.9    151.8  fits
#     4   1    2    2   8    42.0     68.8    68.8    101.8  fits
#     8   1    2    1   8    39.0     68.0    68.0    101.8  fits
# Why: the routed experts are 90% of the parameters (14.4 of 16.0 B), and on one node EP=8 is the only expert
# layout that fits: 8 whole experts per GPU of each of the 26 MoE layers, the token all-to-all on NVLink; with
# expert-DP = 8 / 8 = 1 their Adam state is not sharded, so the experts' fp32 state (master + m + v + grads, 16 B per
# parameter) is most of the 48 GiB. EP=4 needs 80.9 GiB in the rollout phase. Attention is multi-latent (16 heads,
# kv latent 512); TP=2 halves the dense part (attention, the 163840-token vocabulary, the shared experts) and turns
# on sequence parallelism, which MoE layers need under TP; TP=1 is over by 1.5 GiB, TP=4 or 8 save 2-3 GiB for
# more TP traffic. PP is 1: the 27 layers allow only PP 1, 3, 9 or 27 (uneven stages are not supported).
# Rollout TP=2: an MLA engine caches the latent + RoPE key (576 values per layer and token) on every engine rank,
# so rollout TP does not split the cache, only the weights (29.7 GiB of bf16 in all). At TP=1 the weights leave KV
# cache for 1.8 sequences of 5120 tokens per engine (14 in flight on the node); TP=2 leaves 101.8 per engine
# (407 on the node's 4 engines, each sampling 64 x 16 / 4 = 256 responses a step), TP=4 151.8 per engine but only
# 2 engines (304). Without recompute the activations alone are 31.4 GiB: full recompute (2.0 GiB).
# The router bias stays as the checkpoint has it (train.moe_expert_bias_update_rate 0); docs/moe.md, "DeepSeek-V3
# in training", has the update and what it logs.
#SBATCH --job-name=moonlight-16b-a3b
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
RLVR_CONFIG=${RLVR_CONFIG:-configs/moonlight_16b_a3b.yaml}
# shellcheck source=slurm/common.sh
source "$RLVR_HOME/slurm/common.sh"
rlvr_main
