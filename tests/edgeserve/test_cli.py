"""The `edgeserve` command: every module of edgeserve.commands adds its sub-commands, and
`python -m edgeserve` is the same command."""

from __future__ import annotations

import subprocess
import sys

import typer.main

from edgeserve.cli import build_app


def test_every_command_module_registers_its_commands() -> None:
    command = typer.main.get_command(build_app())
    assert sorted(command.commands) == [  # type: ignore[attr-defined]
        "billing", "gateway", "keys", "limits", "model", "node", "run", "up",
    ]  # fmt: skip


def test_python_dash_m_edgeserve_is_the_same_command() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "edgeserve", "--help"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert "edgeserve: serverless LLM inference" in result.stdout
    assert "│ keys " in result.stdout and "│ up " in result.stdout
