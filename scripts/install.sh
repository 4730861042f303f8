#!/usr/bin/env bash
# Installs edgeserve into ./.venv and pulls the SmolLM2 weights. Idempotent.
#
#   bash scripts/install.sh           # service: runtime deps + Triton
#   bash scripts/install.sh --test    # also the test extras (transformers, openai, ...)
#
# torch: the CPU build by default (small). On a GPU host set
#   EDGESERVE_TORCH="torch==2.13.0" EDGESERVE_TORCH_INDEX=https://download.pytorch.org/whl/cu128
# (or any CUDA index) before running this script.
set -euo pipefail
cd "$(dirname "$0")/.."

extras="kernels"
[ "${1:-}" = "--test" ] && extras="kernels,test"

python=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$python" -m venv .venv
fi
pip_install=(.venv/bin/python -m pip install -q --disable-pip-version-check)
# Local wheel mirrors, when the machine has them (a CPU torch build lies there).
if [ -d /opt/wheels ]; then pip_install+=(--find-links /opt/wheels); fi

torch_spec=${EDGESERVE_TORCH:-torch==2.13.0}
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    if [ -n "${EDGESERVE_TORCH_INDEX:-}" ]; then
        "${pip_install[@]}" --index-url "$EDGESERVE_TORCH_INDEX" "$torch_spec"
    elif ls /opt/wheels/torch-2.13.0+cpu-*.whl >/dev/null 2>&1; then
        "${pip_install[@]}" "$torch_spec"
    else
        # No local CPU wheel: ask PyTorch's CPU index so a CPU-only host stays small.
        "${pip_install[@]}" "$torch_spec" --index-url https://download.pytorch.org/whl/cpu \
            || "${pip_install[@]}" "$torch_spec"
    fi
fi
"${pip_install[@]}" -e ".[${extras}]"
.venv/bin/edgeserve model pull smollm2
