#!/usr/bin/env bash
# Qwen2.5-VL-7B-Instruct, CPGD on MMK12-shaped multimodal math, 2 nodes x 8 GPUs (80 GB): one srun task per GPU
# running `megatron-rlvr train`.
#
#   mkdir -p logs && MMK12_TRAIN=/data/mmk12/train.parquet sbatch slurm/cpgd_vl_7b.sh   # from the repo root
#   RLVR_OVERRIDES="optimizer.lr=5e-7" sbatch slurm/cpgd_vl_7b.sh
#   sbatch --nodes=4 --partition=gpu --account=myproj --time=24:00:00 slurm/cpgd_vl_7b.sh   # sbatch flags win
#   RLVR_DRY_RUN=1 bash slurm/cpgd_vl_7b.sh                # (with SLURM_* set) print the srun line, run nothing
#
# Data: MMK12_TRAIN (default /shared/data/mmk12/train.parquet), rows with `image`/`images` + `question`/`problem` +
# `answer` (docs/vlm.md). Environment overrides (see slurm/common.sh for details): RLVR_HOME RLVR_CONFIG
# RLVR_OVERRIDES RLVR_CMD RLVR_RUN_DIR RLVR_VENV RLVR_SETUP RLVR_MAX_REQUEUES RLVR_SRUN_WAIT_S RLVR_SRUN_EXTRA
# CONTAINER_IMAGE CONTAINER_MOUNTS CONTAINER_WORKDIR RLVR_DRY_RUN. #SBATCH values are overridden by sbatch flags or
# SBATCH_* variables (SBATCH_PARTITION, SBATCH_ACCOUNT, SBATCH_TIMELIMIT, ...).
# Logs: logs/<job name>-<job id>.out (appended across requeues). Run dir: runs/<job name>-<job id>/.
# Preemption: 180 s before the time limit every task gets SIGUSR1, the trainer checkpoints and exits 75, and
# the job requeues itself and resumes (contract in slurm/common.sh).
#
# Layout (configs/cpgd_qwen2_5_vl_7b.yaml): training TP=4, PP=1 (DP=4), rollout TP=1 (16 vLLM engines), full
# recompute, the vision tower trained. `megatron-rlvr plan configs/cpgd_qwen2_5_vl_7b.yaml --search` on 2 x 8 x 80
# GiB, micro-batch 8192 tokens, max sequence 2048 + 4096, vLLM gpu_memory_utilization 0.5 (GiB per GPU; usable
# 73.6 = 80 x 0.92; the tower sees 10920 patches per micro-batch, the prompt share of its tokens as image tokens):
#    tp  pp  rtp   dp   train  rollout    peak  kv seqs  verdict
#     1   1    1   16    85.3    101.2   101.2     68.7  no: training phase needs 85.3 GiB
#     2   1    1    8    59.1     79.9    79.9     68.7  no: rollout phase needs 79.9 GiB (training state 37.9 + vLLM 40)
#     1   2    1    8    70.4     79.9    79.9     68.7  no: rollout phase needs 79.9 GiB
#     4   1    1    4    46.1     69.3    69.3     68.7  fits   <- chosen
#     4   1    2    4    46.1     69.3    69.3    184.5  fits
#     2   2    1    4    58.4     69.3    69.3     68.7  fits
#     4   2    1    2    52.4     64.0    64.0     68.7  fits
# Why: the vision tower is a plain module on pipeline stage 0, whole on every GPU there: 0.68 B params, i.e. 1.3
# GiB of weights, 10.1 GiB of fp32 grads + Adam state (not sharded by the distributed optimizer) and 13.3 GiB of
# activations when trained (no recompute inside the tower). TP does not shrink it, so the language model must give
# the room: TP=2 leaves 37.9 GiB of training state next to vLLM's 40 GiB (79.9 > 73.6); TP=4 brings it to 27.3
# (peak 69.3) and stays inside one node's NVLink domain. PP=2 x TP=2 fits too but puts the whole tower and the
# embedding on stage 0 and adds a pipeline bubble; TP=4 x PP=2 halves DP for memory we do not need. Rollout TP=1:
# one 15.5 GiB engine per GPU keeps a KV cache of 68.7 max-length sequences (422k tokens), more than each of the
# 16 engines' share of a step (128 prompts x 8 rollouts / 16 = 64 sequences), with no TP all-reduce per token.
# Freezing the tower (model.vision.freeze, where the model supports it) drops the training peak to 23.1 GiB.
#SBATCH --job-name=cpgd-vl-7b
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
RLVR_CONFIG=${RLVR_CONFIG:-configs/cpgd_qwen2_5_vl_7b.yaml}
# shellcheck source=slurm/common.sh
source "$RLVR_HOME/slurm/common.sh"
rlvr_main
