"""The fleet's deployment files (infra/compose.yaml, infra/k8s/edgeserve.yaml): every process
they start is a command the CLI takes, and usage reaches one shared ledger."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from edgeserve.cli import build_app

INFRA = Path(__file__).resolve().parents[2] / "infra"
K8S = INFRA / "k8s" / "edgeserve.yaml"
COMPOSE = INFRA / "compose.yaml"
DATABASE_URL = {"name": "DATABASE_URL", "valueFrom": {"secretKeyRef": {"name": "edgeserve", "key": "database-url"}}}  # fmt: skip


def k8s_workloads() -> dict[str, dict[str, Any]]:
    """Deployment or StatefulSet name -> its document."""
    documents = [d for d in yaml.safe_load_all(K8S.read_text()) if d]
    return {
        d["metadata"]["name"]: d for d in documents if d["kind"] in ("Deployment", "StatefulSet")
    }


def k8s_containers() -> dict[str, dict[str, Any]]:
    """Workload name -> its one container."""
    return {
        name: d["spec"]["template"]["spec"]["containers"][0] for name, d in k8s_workloads().items()
    }


def image_home() -> str:
    """EDGESERVE_HOME as the image sets it: where a gateway's usage journal lives."""
    for line in (INFRA / "Dockerfile").read_text().splitlines():
        if line.startswith("ENV ") and "EDGESERVE_HOME=" in line:
            return line.split("EDGESERVE_HOME=")[1].split()[0]
    raise AssertionError("the Dockerfile sets no EDGESERVE_HOME")


def edgeserve_args(command: list[str]) -> list[str]:
    """The arguments after `edgeserve` (through a `sh -c "exec edgeserve ..."` too)."""
    if command[:2] == ["sh", "-c"]:
        command = shlex.split(command[2])
        command = command[1:] if command[0] == "exec" else command
    assert command[0] == "edgeserve", command
    return command[1:]


def test_the_k8s_fleet_runs_a_billing_worker_on_the_gateways_ledger() -> None:
    containers = k8s_containers()
    assert set(containers) == {"edgeserve-gateway", "edgeserve-node", "edgeserve-billing-worker"}
    worker = containers["edgeserve-billing-worker"]
    assert worker["command"] == ["edgeserve", "billing", "worker"]
    for name in ("edgeserve-gateway", "edgeserve-billing-worker"):
        env = {e["name"]: e for e in containers[name]["env"]}
        assert env["DATABASE_URL"] == DATABASE_URL, name
        assert env["REDIS_URL"]["valueFrom"]["secretKeyRef"]["key"] == "redis-url", name


def test_k8s_gateways_keep_their_journal_across_restarts() -> None:
    """The journal is named by host name and lives in EDGESERVE_HOME: a gateway must come
    back under its own name, with its own volume there, to replay what it journaled."""
    gateway = k8s_workloads()["edgeserve-gateway"]
    assert gateway["kind"] == "StatefulSet"
    (claim,) = gateway["spec"]["volumeClaimTemplates"]
    mounts = k8s_containers()["edgeserve-gateway"]["volumeMounts"]
    assert mounts == [{"name": claim["metadata"]["name"], "mountPath": image_home()}]
    services = {
        d["metadata"]["name"]: d
        for d in yaml.safe_load_all(K8S.read_text())
        if d and d["kind"] == "Service"
    }
    assert services[gateway["spec"]["serviceName"]]["spec"]["clusterIP"] == "None"


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


def fleet_commands() -> list[list[str]]:
    compose = yaml.safe_load(COMPOSE.read_text())
    commands = [
        s["command"] for s in compose["services"].values() if "edgeserve" in str(s.get("command"))
    ]
    commands += [c["command"] for c in k8s_containers().values()]
    return commands


@pytest.mark.parametrize("command", fleet_commands(), ids=lambda c: " ".join(c)[:60])
def test_every_fleet_command_is_one_the_cli_takes(command: list[str]) -> None:
    # --help after the file's own options: an option the command does not know fails first.
    args = [
        a.replace("$POD_IP", "10.0.0.1").replace("$POD_NAME", "pod")
        for a in edgeserve_args(command)
    ]
    result = CliRunner().invoke(build_app(), [*args, "--help"])
    assert result.exit_code == 0, result.output


def test_compose_redis_fsyncs_every_write_before_acknowledging_it() -> None:
    """Usage a gateway handed to Redis must survive a host crash: everysec can drop a second."""
    command = yaml.safe_load(COMPOSE.read_text())["services"]["redis"]["command"]
    assert command[command.index("--appendonly") + 1] == "yes"
    assert command[command.index("--appendfsync") + 1] == "always"


def test_the_image_copies_every_package_the_project_installs() -> None:
    """A package left out of the image installs nothing and fails at import."""
    import tomllib

    dockerfile = (Path(__file__).resolve().parents[2] / "infra" / "Dockerfile").read_text()
    copied = {line.split()[1] for line in dockerfile.splitlines() if line.startswith("COPY ")}
    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    packages = pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    assert {name.rstrip("*") for name in packages} <= copied
