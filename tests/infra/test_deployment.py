"""The deployment files are checked by the tools built for them, and the gateway image
carries no engine.

    compose file        docker-compose config (Debian's docker-compose; no engine needed)
    k8s manifests       kubernetes-validate, against the Kubernetes schemas it ships
    Dockerfile          hadolint
    gateway image       installs the service's own dependencies only, and a gateway
                        process with every engine module blocked serves
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import tomllib
import uuid
from pathlib import Path

import httpx
import pytest

from tests.conftest import INTERNAL_TOKEN, REDIS_URL, free_port

ROOT = Path(__file__).resolve().parents[2]
INFRA = ROOT / "infra"
BIN = Path(sys.executable).parent
# What only the engine imports: a gateway that needed any of them would fail without it.
ENGINE_MODULES = ("torch", "triton", "numpy", "gguf", "tokenizers", "jinja2", "transformers")


def _run(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        args, cwd=ROOT, capture_output=True, text=True, timeout=120, env=os.environ | env
    )


def test_the_compose_file_is_one_docker_compose_reads() -> None:
    compose = shutil.which("docker-compose")
    if compose is None:
        pytest.skip("docker-compose is not installed (apt-get install docker-compose)")
    checked = _run(
        compose, "-f", str(INFRA / "compose.yaml"), "config", "--quiet",
        EDGESERVE_INTERNAL_TOKEN="0123456789abcdef0123",
    )  # fmt: skip
    assert checked.returncode == 0, checked.stderr
    unset = _run(compose, "-f", str(INFRA / "compose.yaml"), "config", "--quiet")
    assert unset.returncode != 0  # the internal token is required, not defaulted
    assert "set a shared internal token" in unset.stderr


def test_the_k8s_manifests_pass_the_kubernetes_schemas() -> None:
    manifests = sorted(str(path) for path in (INFRA / "k8s").glob("*.yaml"))
    checked = _run(str(BIN / "kubernetes-validate"), *manifests)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    passed = [line for line in checked.stdout.splitlines() if " passed for resource " in line]
    assert len(passed) >= 5, checked.stdout  # the gateways, their services, nodes, billing
    # KEDA's ScaledObject is a custom resource: no built-in schema, so its own test
    # (tests/gateway/test_autoscaling_metrics.py) checks it.
    unknown = [line for line in checked.stdout.splitlines() if "Couldn't find schema" in line]
    assert all("ScaledObject" in line for line in unknown), unknown


def test_the_dockerfile_passes_hadolint() -> None:
    checked = _run(str(BIN / "hadolint"), str(INFRA / "Dockerfile"))
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_the_gateway_image_installs_no_engine() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = {dep.split(">")[0].split("=")[0].split("[")[0].split(";")[0].strip()
             for dep in project["dependencies"]}  # fmt: skip
    assert names.isdisjoint(ENGINE_MODULES)
    dockerfile = (INFRA / "Dockerfile").read_text()
    gateway_stage = dockerfile.split("FROM source AS gateway", 1)[1].split("FROM ", 1)[0]
    assert "RUN pip install --no-cache-dir .\n" in gateway_stage
    assert "torch" not in gateway_stage and "[engine" not in gateway_stage


def test_a_gateway_process_serves_with_every_engine_module_blocked() -> None:
    port = free_port()
    blocked = "; ".join(f"sys.modules[{name!r}] = None" for name in ENGINE_MODULES)
    program = f"import sys; {blocked}; from edgeserve.cli import main; main()"
    gateway = subprocess.Popen(
        [sys.executable, "-c", program, "gateway", "--port", str(port), "--redis-url",
         REDIS_URL, "--prefix", f"test:torchless-{uuid.uuid4().hex[:8]}:",
         "--internal-token", INTERNAL_TOKEN],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while True:
            assert gateway.poll() is None, gateway.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the gateway never answered"
            try:
                health = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1)
                break
            except httpx.HTTPError:
                time.sleep(0.1)
        assert health.status_code == 200
        described = httpx.get(f"http://127.0.0.1:{port}/openapi.json", timeout=5)
        assert described.status_code == 200
        # No node serves this Redis prefix: a request is refused in its dialect, not a 500.
        asked = httpx.post(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            json={"model": "@cf/huggingface/smollm2-135m-instruct", "messages": []},
            timeout=5,
        )
        assert asked.status_code == 401  # no key: refused before anything else
    finally:
        gateway.terminate()
        gateway.wait(timeout=30)
