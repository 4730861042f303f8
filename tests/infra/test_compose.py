"""infra/compose.yaml: a file docker-compose reads (Debian's docker-compose; no engine
needed), every process it starts a command the CLI takes, one ledger for all of them, and
journals and Redis writes that survive a restart."""

from __future__ import annotations

import shutil

import pytest
import yaml
from typer.testing import CliRunner

from edgeserve.cli import build_app
from tests.infra.files import COMPOSE, edgeserve_args, image_home, run_tool


def test_the_compose_file_is_one_docker_compose_reads() -> None:
    compose = shutil.which("docker-compose")
    if compose is None:
        pytest.skip("docker-compose is not installed (apt-get install docker-compose)")
    checked = run_tool(
        compose, "-f", str(COMPOSE), "config", "--quiet",
        EDGESERVE_INTERNAL_TOKEN="0123456789abcdef0123",
    )  # fmt: skip
    assert checked.returncode == 0, checked.stderr
    unset = run_tool(compose, "-f", str(COMPOSE), "config", "--quiet")
    assert unset.returncode != 0  # the internal token is required, not defaulted
    assert "set a shared internal token" in unset.stderr


def test_compose_gateways_and_node_keep_their_journal_across_recreation() -> None:
    compose = yaml.safe_load(COMPOSE.read_text())
    for name in ("gateway-1", "gateway-2", "node-1"):
        service = compose["services"][name]
        assert service["hostname"] == name
        assert service["volumes"] == [f"{name}:{image_home()}"]
        assert name in compose["volumes"]


def test_the_compose_fleet_gives_every_process_one_ledger() -> None:
    compose = yaml.safe_load(COMPOSE.read_text())
    worker = compose["services"]["billing-worker"]
    assert worker["command"] == ["edgeserve", "billing", "worker"]
    assert worker["environment"]["DATABASE_URL"].startswith("postgresql://")
    assert compose["services"]["gateway-1"]["environment"] == worker["environment"]


def test_compose_redis_fsyncs_every_write_before_acknowledging_it() -> None:
    """Usage a gateway handed to Redis must survive a host crash: everysec can drop a second."""
    command = yaml.safe_load(COMPOSE.read_text())["services"]["redis"]["command"]
    assert command[command.index("--appendonly") + 1] == "yes"
    assert command[command.index("--appendfsync") + 1] == "always"


def compose_commands() -> list[list[str]]:
    compose = yaml.safe_load(COMPOSE.read_text())
    return [
        s["command"] for s in compose["services"].values() if "edgeserve" in str(s.get("command"))
    ]


@pytest.mark.parametrize("command", compose_commands(), ids=lambda c: " ".join(c)[:60])
def test_every_compose_command_is_one_the_cli_takes(command: list[str]) -> None:
    # --help after the file's own options: an option the command does not know fails first.
    result = CliRunner().invoke(build_app(), [*edgeserve_args(command), "--help"])
    assert result.exit_code == 0, result.output
