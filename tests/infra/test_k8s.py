"""infra/k8s/: the manifests pass the Kubernetes schemas (kubernetes-validate, against the
schemas it ships), every process they start is a command the CLI takes, the billing worker
bills into the gateways' ledger, gateways keep their journal across restarts, and the KEDA
example (autoscaling.yaml) queries only gauges the gateway exports."""

from __future__ import annotations

import re
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from edgeserve.cli import build_app
from tests.infra.files import BIN, INFRA, K8S, edgeserve_args, image_home, run_tool

AUTOSCALING = INFRA / "k8s" / "autoscaling.yaml"
DATABASE_URL = {"name": "DATABASE_URL", "valueFrom": {"secretKeyRef": {"name": "edgeserve", "key": "database-url"}}}  # fmt: skip
# The autoscaling gauges a gateway exports on /metrics (tests/gateway/dashboard/test_fleet.py
# reads them there).
GAUGES = (
    "edgeserve_queue_waiting_requests",
    "edgeserve_model_waiting_requests",
    "edgeserve_model_running_requests",
    "edgeserve_model_kv_utilization_ratio",
    "edgeserve_model_nodes",
)


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


def test_the_k8s_manifests_pass_the_kubernetes_schemas() -> None:
    manifests = sorted(str(path) for path in (INFRA / "k8s").glob("*.yaml"))
    checked = run_tool(str(BIN / "kubernetes-validate"), *manifests)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    passed = [line for line in checked.stdout.splitlines() if " passed for resource " in line]
    assert len(passed) >= 5, checked.stdout  # the gateways, their services, nodes, billing
    # KEDA's ScaledObject is a custom resource: no built-in schema, so its own test
    # (test_the_keda_example_parses_and_queries_only_gauges_the_gateway_exports) checks it.
    unknown = [line for line in checked.stdout.splitlines() if "Couldn't find schema" in line]
    assert all("ScaledObject" in line for line in unknown), unknown


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


@pytest.mark.parametrize(
    "command", [c["command"] for c in k8s_containers().values()], ids=lambda c: " ".join(c)[:60]
)
def test_every_k8s_command_is_one_the_cli_takes(command: list[str]) -> None:
    # --help after the file's own options: an option the command does not know fails first.
    result = CliRunner().invoke(build_app(), [*edgeserve_args(command), "--help"])
    assert result.exit_code == 0, result.output


def test_the_keda_example_parses_and_queries_only_gauges_the_gateway_exports() -> None:
    (scaled,) = list(yaml.safe_load_all(AUTOSCALING.read_text()))
    assert (scaled["apiVersion"], scaled["kind"]) == ("keda.sh/v1alpha1", "ScaledObject")
    assert scaled["spec"]["scaleTargetRef"]["name"] == "edgeserve-node"
    triggers = scaled["spec"]["triggers"]
    assert {t["type"] for t in triggers} == {"prometheus"}
    queried = {
        name for t in triggers for name in re.findall(r"edgeserve_[a-z_]+", t["metadata"]["query"])
    }
    assert queried == {
        "edgeserve_queue_waiting_requests",
        "edgeserve_model_waiting_requests",
        "edgeserve_model_kv_utilization_ratio",
    }
    assert queried <= set(GAUGES)
    for t in triggers:
        float(t["metadata"]["threshold"])  # KEDA takes the threshold as a string of a number
