"""The tree passes the project's own linters (config in pyproject.toml)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_ruff_check_and_format() -> None:
    check = run(str(BIN / "ruff"), "check", ".")
    assert check.returncode == 0, check.stdout + check.stderr
    fmt = run(str(BIN / "ruff"), "format", "--check", ".")
    assert fmt.returncode == 0, fmt.stdout + fmt.stderr


def test_mypy_on_the_packages() -> None:
    result = run(
        str(BIN / "mypy"), "common", "gateway", "gpu_node", "scheduler", "billing", "edgeserve"
    )
    assert result.returncode == 0, result.stdout + result.stderr
