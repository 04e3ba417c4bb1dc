#!/usr/bin/env bash
# Download the wheels tools/gpu_check.sh installs on a GPU machine that has PyTorch, transformers and Triton but no
# network: megatron-core and this package's small dependencies that such an image lacks, for Python 3.12 on
# manylinux x86-64, into .gpu-wheels/ (git-ignored). Run it here (with network), then carry .gpu-wheels with the
# working tree; tools/gpu_check.sh installs them with `pip install --no-index --no-deps --target`.
#
#   bash tools/gpu_wheels.sh            # ~3 MB; prints each wheel and what it requires
#
# Environment: GPU_CHECK_WHEELS (folder, default .gpu-wheels), PYTHON (the pip to use, default python3),
# GPU_WHEELS_PYTHON_VERSION (default 3.12). The pins follow pyproject.toml (megatron-core: the release CI runs).
# Everything else the package imports (torch, transformers, tokenizers, safetensors, numpy, pyyaml, psutil, pyarrow,
# matplotlib, sympy, packaging, pytest, pytest-timeout, accelerate) is expected on the image; the requirements
# printed below say what each wheel needs.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${GPU_CHECK_WHEELS:-.gpu-wheels}
PY=${PYTHON:-python3}
PYVER=${GPU_WHEELS_PYTHON_VERSION:-3.12}
LIMIT_MB=48  # of the 64 MiB a device call carries: leave room for the working tree itself
WHEELS=(
  megatron-core==0.16.1
  omegaconf==2.4.0
  math-verify==0.9.0
  latex2sympy2_extended==1.11.0  # math-verify's parser
  antlr4-python3-runtime==4.13.2  # latex2sympy2_extended's runtime
)
rm -rf "$DEST"
mkdir -p "$DEST"
"$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version "$PYVER" \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$DEST" "${WHEELS[@]}" 2> >(grep -v "^WARNING: Location" >&2)
[ "$(find "$DEST" -name '*.whl' | wc -l)" -eq "${#WHEELS[@]}" ] || { echo "gpu_wheels: expected ${#WHEELS[@]} wheels in $DEST" >&2; exit 1; }
for w in "$DEST"/*.whl; do
  reqs=$(unzip -p "$w" '*.dist-info/METADATA' | sed -n 's/^Requires-Dist: //p' | grep -v 'extra ==' | tr '\n' ';' || true)
  printf '%8s  %s  requires: %s\n' "$(du -k "$w" | cut -f1)K" "$(basename "$w")" "${reqs:-nothing}"
done
total_kb=$(du -sk "$DEST" | cut -f1)
echo "gpu_wheels: ${#WHEELS[@]} wheels, $((total_kb / 1024)) MiB in $DEST (limit $LIMIT_MB MiB)"
[ "$total_kb" -le $((LIMIT_MB * 1024)) ] || { echo "gpu_wheels: over $LIMIT_MB MiB" >&2; exit 1; }
