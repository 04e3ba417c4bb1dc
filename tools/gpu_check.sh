#!/usr/bin/env bash
# GPU check: one command on a machine with one NVIDIA GPU, < 10 minutes. Runs with the project's .venv where it has
# megatron-core (a full set-up: `MEGATRON_RLVR_EXTRAS=dev,gpu bash tools/setup.sh`), else with the machine's own
# python3 (an image with PyTorch, transformers and Triton but no megatron-core and no network): the wheels in
# .gpu-wheels/ (made here by `bash tools/gpu_wheels.sh`, carried with the working tree) are installed into a scratch
# folder put first on PYTHONPATH; nothing of the image is changed. Then tools/gpu_check.py runs:
#   - the GPU-marked tests (pytest -m "gpu and not vllm"; with vLLM importable -m "gpu or vllm": the vLLM engine tests
#     on CUDA too, and the weight-sync and rollout benchmarks),
#   - the main job end to end on one GPU (the tiny preset), and a realistic one: Qwen2.5-0.5B's shape, randomly
#     initialised, bf16, the transformers rollout engine (step time, phase times, model FLOPs utilisation),
#   - the vocab-parallel statistics against the memory-bandwidth floor (bytes that must move / measured time),
# and prints a table last, listing what could not run (vLLM, Transformer Engine, Apex, NCCL at TP > 1) and why.
# Without CUDA the same runs as a dry run on the CPU with reduced shapes.
#
#   bash tools/gpu_wheels.sh                      # here, with network: .gpu-wheels/ (~3 MB)
#   bash tools/gpu_check.sh                       # there: install what is missing, run, table last
#   GPU_CHECK_LOG_DIR=$OUT bash tools/gpu_check.sh --only qwen,vocab
#
# Environment: PYTHON (interpreter), GPU_CHECK_LOG_DIR (logs and summary.txt, at most 7 files, default
# /tmp/megatron-rlvr-gpu-check; the run directories go beside it, into LOG_DIR-work), GPU_CHECK_WHEELS (default
# .gpu-wheels), GPU_CHECK_SITE (where the wheels are installed, default /tmp/megatron-rlvr-gpu-site),
# GPU_CHECK_PEAK_TFLOPS (dense bf16 peak for the MFU when the GPU is not known), GPU_CHECK_TEST_TIMEOUT (s).
# Arguments go to tools/gpu_check.py (--only, --tokens, --qwen-steps, ...). On the lent machine: carry .gpu-wheels,
# command `GPU_CHECK_LOG_DIR=$OUT bash tools/gpu_check.sh`, timeout 600 s.
# Exit status: 0 when every check that ran passed.
set -uo pipefail
cd "$(dirname "$0")/.."
LOG_DIR=${GPU_CHECK_LOG_DIR:-/tmp/megatron-rlvr-gpu-check}
WHEELS=${GPU_CHECK_WHEELS:-.gpu-wheels}
SITE=${GPU_CHECK_SITE:-/tmp/megatron-rlvr-gpu-site}
NEEDED="megatron.core omegaconf math_verify latex2sympy2_extended antlr4"
mkdir -p "$LOG_DIR"

missing() {  # the modules of $NEEDED that "$1" cannot import
  "$1" -c "
import importlib.util, sys
print(' '.join(m for m in sys.argv[1:] if importlib.util.find_spec(m.split('.')[0]) is None
               or (m == 'megatron.core' and importlib.util.find_spec(m) is None)))" $NEEDED 2>/dev/null || echo "$NEEDED"
}

if [ -n "${PYTHON:-}" ]; then
  PY=$PYTHON
elif [ -x .venv/bin/python ] && [ -z "$(missing .venv/bin/python)" ]; then
  PY=.venv/bin/python
else
  PY=python3
fi
echo "== environment"
nvidia-smi -L 2>/dev/null || echo "nvidia-smi: not found (no NVIDIA driver: dry run on the CPU)"
"$PY" -c 'import sys, torch, transformers; print("python", sys.version.split()[0], sys.executable, "| torch",
torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available(), "| transformers",
transformers.__version__)' || { echo "gpu_check: $PY has no working torch + transformers" >&2; exit 1; }

lacking=$(missing "$PY")
if [ -n "$lacking" ]; then
  if ! ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    echo "gpu_check: $PY lacks $lacking and there are no wheels in $WHEELS: run 'bash tools/gpu_wheels.sh' on a" \
      "machine with network and carry $WHEELS with the working tree" >&2
    exit 1
  fi
  echo "== installing $(ls "$WHEELS"/*.whl | wc -l) carried wheels into $SITE (missing: $lacking)"
  "$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" "$WHEELS"/*.whl || { echo "gpu_check: installing the wheels failed" >&2; exit 1; }
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
  lacking=$(missing "$PY")
  [ -z "$lacking" ] || { echo "gpu_check: still missing after the install: $lacking" >&2; exit 1; }
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -W ignore -c 'import megatron.core as m, omegaconf, math_verify; print("megatron-core", m.__version__)' \
  || { echo "gpu_check: megatron-core does not import" >&2; exit 1; }
exec "$PY" tools/gpu_check.py --log-dir "$LOG_DIR" "$@"
