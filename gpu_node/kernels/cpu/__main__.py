"""`python -m gpu_node.kernels.cpu`: build this machine's CPU decode kernels now (install.sh
runs it, so a first request does not wait for the compiler)."""

import subprocess

from gpu_node.kernels.cpu import build

try:
    print(f"CPU decode kernels: {build()}")
except (RuntimeError, subprocess.TimeoutExpired) as e:
    print(f"CPU decode kernels not built ({e}); the engine uses torch's ops")
