"""The deployment files (infra/) as their tests read them, and the tools that check them."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
INFRA = ROOT / "infra"
COMPOSE = INFRA / "compose.yaml"
K8S = INFRA / "k8s" / "edgeserve.yaml"
DOCKERFILE = INFRA / "Dockerfile"
BIN = Path(sys.executable).parent


def run_tool(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        args, cwd=ROOT, capture_output=True, text=True, timeout=120, env=os.environ | env
    )


def image_home() -> str:
    """EDGESERVE_HOME as the image sets it: where a gateway's usage journal lives."""
    for line in DOCKERFILE.read_text().splitlines():
        if line.startswith("ENV ") and "EDGESERVE_HOME=" in line:
            return line.split("EDGESERVE_HOME=")[1].split()[0]
    raise AssertionError("the Dockerfile sets no EDGESERVE_HOME")


def edgeserve_args(command: list[str]) -> list[str]:
    """The arguments after `edgeserve` (through a `sh -c "exec edgeserve ..."` too), with the
    pod's variables filled in."""
    if command[:2] == ["sh", "-c"]:
        command = shlex.split(command[2])
        command = command[1:] if command[0] == "exec" else command
    assert command[0] == "edgeserve", command
    return [a.replace("$POD_IP", "10.0.0.1").replace("$POD_NAME", "pod") for a in command[1:]]
